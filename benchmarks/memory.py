"""Per-rank bytes of parameters, gradients and optimizer state for a preset, by data-parallel size
and layout, from the model's real parameter shapes (built on the meta device: no memory, no init).

    python -m benchmarks.memory [--preset DiT-7B --preset DiT-28B --dp 1 2 4 --precision bf16]

Each row shows rank 0's bytes counted from the shapes (a sharded parameter gives each rank whole
rows, as Megatron-FSDP does) next to the closed form of ``dfm.training.memory`` (``P`` parameters,
``D`` ranks: DDP 2P + 4P + 12P; distributed optimizer 12P / D; FSDP optim_grads_params everything
/ D, for bf16 with fp32 gradients and Adam), and the total as a fraction of DDP's at DP=1.
TP = PP = CP = 1: the whole model is one rank's share.
"""

from __future__ import annotations

import argparse
import logging
import warnings
from dataclasses import dataclass

import torch

from dfm.config.container import ModelConfig
from dfm.config.presets import PRESETS
from dfm.training.memory import RankBytes, bytes_per_parameter, formula_bytes, shape_bytes

LAYOUTS = ("ddp", "distributed_optimizer", "optim_grads_params")
GIB = 2**30


@dataclass(frozen=True)
class Row:
    preset: str
    dp: int
    layout: str
    from_shapes: RankBytes
    formula: RankBytes
    fraction: float  # total / the DDP total at DP=1


def parameter_shapes(preset: str) -> list[tuple[int, ...]]:
    """Every parameter's shape of ``preset`` (one process, TP = PP = 1), built on the meta device."""
    from megatron.core import parallel_state

    from dfm.models.build import build_model
    from dfm.platform.distributed import destroy_distributed, initialize_distributed

    own_state = not parallel_state.model_parallel_is_initialized()
    if own_state:
        initialize_distributed()
    try:
        with torch.device("meta"):
            model, _ = build_model(ModelConfig(**{**PRESETS[preset], "attention_backend": "sdpa"}), "bf16")
        return [tuple(p.shape) for p in model.parameters()]
    finally:
        if own_state:
            destroy_distributed()


def memory_rows(preset: str, shapes, dps=(1, 2, 4), precision: str = "bf16") -> list[Row]:
    count = sum(torch.Size(s).numel() for s in shapes)
    rows, baseline = [], None
    for dp in dps:
        for layout in LAYOUTS:
            per = bytes_per_parameter(precision, True, "adam", fsdp=layout == "optim_grads_params")
            from_shapes = shape_bytes(shapes, per, layout, dp)
            baseline = baseline or from_shapes.total
            rows.append(Row(preset, dp, layout, from_shapes, formula_bytes(count, per, layout, dp), 0.0))
    return [Row(**{**row.__dict__, "fraction": row.from_shapes.total / baseline}) for row in rows]


def format_rows(rows: list[Row]) -> str:
    head = f"{'preset':9s} {'DP':>2s} {'layout':22s} {'params':>8s} {'grads':>8s} {'optim':>8s} {'total':>8s}"
    lines = [head + f" {'formula total':>13s} {'x DDP@1':>7s}   (GiB per rank)"]
    for r in rows:
        b = r.from_shapes
        lines.append(
            f"{r.preset:9s} {r.dp:2d} {r.layout:22s} {b.params / GIB:8.2f} {b.grads / GIB:8.2f} "
            f"{b.optimizer / GIB:8.2f} {b.total / GIB:8.2f} {r.formula.total / GIB:13.2f} {r.fraction:7.3f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", action="append", choices=list(PRESETS), help="repeatable; default DiT-7B, DiT-28B")
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    args = parser.parse_args(argv)
    logging.getLogger("megatron").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    for preset in args.preset or ["DiT-7B", "DiT-28B"]:
        shapes = parameter_shapes(preset)
        print(f"{preset}: {sum(torch.Size(s).numel() for s in shapes):,d} parameters")
        print(format_rows(memory_rows(preset, shapes, args.dp, args.precision)))


if __name__ == "__main__":
    main()
