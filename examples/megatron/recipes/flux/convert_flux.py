"""FLUX.1 weights between a diffusers folder (FluxTransformer2DModel) and a dfm checkpoint.

    python convert_flux.py import --diffusers FLUX.1-dev --output ckpt/flux-dev --recipe FLUX.1-dev --verify
    python convert_flux.py export --checkpoint ckpt/run --output flux-finetuned [--dtype bf16] [--overwrite]

``--diffusers`` takes the pipeline folder or its ``transformer/``. Both directions stream one tensor at a
time and replace ``--output`` only when complete (see dfm/convert/cli.py).

Train from an import with ``checkpoint.pretrained=ckpt/flux-dev`` (any parallel layout).
"""

import sys

from dfm.convert.cli import main
from dfm.convert.flux import FLUX
from dfm.platform.process_exit import skip_final_gc_at_exit

if __name__ == "__main__":
    skip_final_gc_at_exit()
    sys.exit(main(FLUX))
