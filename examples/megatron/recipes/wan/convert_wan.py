"""Wan: a diffusers ``WanTransformer3DModel`` folder <-> a dfm checkpoint (docs/wan.md); a Wan 2.2
A14B pipeline folder (transformer/ + transformer_2/) <-> one checkpoint per expert.

    python convert_wan.py import --diffusers Wan2.1-T2V-1.3B-Diffusers --output ckpt/wan13b \\
        --recipe Wan2.1-T2V-1.3B --verify
    python convert_wan.py export --checkpoint outputs/run/checkpoints --output wan13b-finetuned [--dtype bf16] [--overwrite]
    python convert_wan.py import --diffusers Wan2.2-T2V-A14B-Diffusers --output ckpt/a14b   # a14b/high_noise, low_noise
    python convert_wan.py export --checkpoint runs/high --checkpoint_2 runs/low --output a14b-finetuned
"""

import sys

from dfm.convert.wan_experts import main
from dfm.platform.process_exit import skip_final_gc_at_exit

if __name__ == "__main__":
    skip_final_gc_at_exit()
    sys.exit(main())
