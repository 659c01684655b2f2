"""Generate a video (mp4) or an image (png) from a DiT checkpoint; see dfm/inference/generate.py.

    python inference_dit_model.py --checkpoint_path outputs/ckpt --prompt "a cat" --num_video_frames 17 \
        --height 256 --width 256 --video_save_path cat.mp4
    python inference_dit_model.py --checkpoint_path outputs/ckpt --tiny_random_encoders   # smoke run, no downloads
"""

import sys

from dfm.inference.generate import main
from dfm.platform.process_exit import skip_final_gc_at_exit

if __name__ == "__main__":  # dist_checkpointing may start worker processes: keep this guard
    skip_final_gc_at_exit()
    main(sys.argv[1:])
