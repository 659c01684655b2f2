"""Exact parameter counts of the presets, built on the meta device (no memory, no init).

python -m dfm.models.presets_cli --all
dfm-params --preset DiT-XL/2
"""

from __future__ import annotations

import argparse
import logging
import warnings

import torch

from dfm.config.container import ModelConfig
from dfm.config.presets import PRESETS


def count_parameters(model_cfg: ModelConfig) -> int:
    """Parameters of the whole (single-stage) model for ``model_cfg``; needs parallel_state."""
    from dfm.models.build import build_model

    with torch.device("meta"):
        model, _ = build_model(model_cfg, "bf16")
    return sum(p.numel() for p in model.parameters())


def preset_parameter_counts(names: list[str]) -> dict[str, int]:
    """{name: parameter count}; starts a one-process parallel_state unless one is running."""
    from megatron.core import parallel_state

    from dfm.platform.distributed import destroy_distributed, initialize_distributed

    own_state = not parallel_state.model_parallel_is_initialized()
    if own_state:
        initialize_distributed()
    try:
        # The meta build never runs a kernel: force the local backend so TE is not needed.
        return {name: count_parameters(ModelConfig(**{**PRESETS[name], "attention_backend": "sdpa"})) for name in names}
    finally:
        if own_state:
            destroy_distributed()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--preset", choices=list(PRESETS), help="one preset")
    group.add_argument("--all", action="store_true", help="every preset")
    args = parser.parse_args(argv)
    logging.getLogger("megatron").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    names = list(PRESETS) if args.all else [args.preset]
    for name, count in preset_parameter_counts(names).items():
        print(f"{name:16s} {PRESETS[name]['architecture']:10s} {count:>16,d}  ({count / 1e9:.3f} B)")


if __name__ == "__main__":
    main()
