"""Wan 2.1 T2V: a diffusers ``WanTransformer3DModel`` folder <-> a dfm checkpoint (docs/wan.md).

    python convert_wan.py import --diffusers Wan2.1-T2V-1.3B-Diffusers --output ckpt/wan13b \\
        --recipe Wan2.1-T2V-1.3B --verify
    python convert_wan.py export --checkpoint outputs/run/checkpoints --output wan13b-finetuned [--dtype bf16] [--overwrite]
"""

import sys

from dfm.convert.cli import main
from dfm.convert.wan import WAN
from dfm.platform.process_exit import skip_final_gc_at_exit

if __name__ == "__main__":
    skip_final_gc_at_exit()
    sys.exit(main(WAN))
