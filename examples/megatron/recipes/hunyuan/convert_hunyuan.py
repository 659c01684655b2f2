"""HunyuanVideo 1.5 weights between a diffusers folder (HunyuanVideo15Transformer3DModel) and a dfm checkpoint.

    python convert_hunyuan.py import --diffusers HunyuanVideo-1.5-Diffusers-720p_t2v --output ckpt/hy15 \
        --recipe HunyuanVideo-1.5-T2V-720p --verify
    python convert_hunyuan.py export --checkpoint ckpt/run --output hy15-finetuned [--dtype bf16] [--overwrite]

``--diffusers`` takes the pipeline folder or its ``transformer/``. Both directions stream one tensor at a
time and replace ``--output`` only when complete (see dfm/convert/cli.py).

Train from an import with ``checkpoint.pretrained=ckpt/hy15`` (any parallel layout).
"""

import sys

from dfm.convert.cli import main
from dfm.convert.hunyuan import HUNYUAN
from dfm.platform.process_exit import skip_final_gc_at_exit

if __name__ == "__main__":
    skip_final_gc_at_exit()
    sys.exit(main(HUNYUAN))
