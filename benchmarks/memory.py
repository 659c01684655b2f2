"""Per-rank memory: the bytes of parameters, gradients and optimizer state of presets by data-parallel
size and layout, or the whole plan of a config, phase by phase (built on the meta device: no memory).

    python -m benchmarks.memory [--preset DiT-7B --preset DiT-28B --dp 1 2 4 --precision bf16]
    python -m benchmarks.memory --config CONF --world-size N [--device-gib 80] [key=value ...]

Preset rows show rank 0's bytes counted from the shapes (a sharded parameter gives each rank whole
rows, as Megatron-FSDP does) next to the closed form of ``dfm.training.memory`` (``P`` parameters,
``D`` ranks: DDP 2P + 4P + 12P; distributed optimizer 12P / D; FSDP optim_grads_params everything
/ D, for bf16 with fp32 gradients and Adam), and the total as a fraction of DDP's at DP=1.
TP = PP = CP = 1: the whole model is one rank's share.

``--config`` prints ``dfm.training.memory_plan`` for the first pipeline stage's ranks (build, training
step with activations under the config's recompute settings, save, load) and whether its peak fits
``--device-gib`` per device; with ``distill.enabled=true`` the plan of the three networks a DMD2
distillation holds (``dfm.training.distill_memory_plan``).
"""

from __future__ import annotations

import argparse
import dataclasses
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
    return model_shapes(ModelConfig(**PRESETS[preset]))


def model_shapes(model_cfg: ModelConfig) -> list[tuple[int, ...]]:
    """Every parameter's shape of ``model_cfg`` at TP = PP = 1, built on the meta device."""
    from megatron.core import parallel_state

    from dfm.models.build import build_model
    from dfm.platform.distributed import destroy_distributed, initialize_distributed

    own_state = not parallel_state.model_parallel_is_initialized()
    if own_state:
        initialize_distributed()
    try:
        with torch.device("meta"):
            single = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1)
            one_process = dataclasses.replace(model_cfg, attention_backend="sdpa", sequence_parallel=False, **single)
            model, _ = build_model(
                dataclasses.replace(
                    one_process, expert_model_parallel_size=1, virtual_pipeline_model_parallel_size=None
                ),
                "bf16",
            )
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


def unchecked_config(recipe: str | None, config_file: str | None, overrides: list[str]):
    """``build_config`` without its layout rules (a refused config can still be planned)."""
    from dfm.config.container import ConfigContainer
    from dfm.config.loader import RECIPE_KEY, apply_mapping, apply_overrides, load_yaml_file
    from dfm.config.recipes import get_recipe

    values = load_yaml_file(config_file) if config_file else {}
    base = recipe or values.pop(RECIPE_KEY, None)
    cfg = get_recipe(base) if base else ConfigContainer()
    apply_mapping(cfg, values)
    apply_overrides(cfg, overrides)
    return cfg


def config_plan_lines(
    config_file: str | None,
    overrides: list[str],
    world_size: int,
    device_gib: float | None,
    samples_per_pack: int = 1,
    recipe: str | None = None,
) -> list[str]:
    """The plan of ``config_file`` + ``overrides`` on ``world_size`` ranks, as printed lines."""
    from dfm.config.loader import build_config
    from dfm.errors import ConfigError
    from dfm.parallel.layout import ParallelLayout
    from dfm.training.distill_memory_plan import describe_distill, distill_plan
    from dfm.training.memory_plan import config_plan, describe
    from dfm.training.pretrain import finalize_defaults

    notes = []
    try:
        cfg = build_config(recipe, config_file, overrides, world_size)
    except ConfigError as refusal:  # still worth planning (a refusal being lifted); say so first
        notes.append(f"note: the trainer refuses this config on this version: {refusal}")
        cfg = unchecked_config(recipe, config_file, overrides)
    layout = ParallelLayout.from_config(cfg.model, world_size)
    finalize_defaults(cfg, layout)
    total = sum(torch.Size(s).numel() for s in model_shapes(cfg.model))
    share = total // (layout.tp * layout.pp)
    device = int(device_gib * GIB) if device_gib else None
    if cfg.distill.enabled:  # three networks: student, critic, frozen teacher
        plan = distill_plan(cfg, layout, share, samples_per_pack)
        described = describe_distill(plan, cfg.mixed_precision.precision, device)
    else:
        described = describe(config_plan(cfg, layout, share, samples_per_pack), device)
    head = (
        f"{config_file or recipe}: {total:,d} parameters on {world_size} ranks (TP {layout.tp}, PP {layout.pp}, "
        f"CP {layout.cp}, DP {layout.dp}), {share:,d} per rank before data-parallel sharding; per rank:"
    )
    return [*notes, head, *("  " + line for line in described)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", action="append", choices=list(PRESETS), help="repeatable; default DiT-7B, DiT-28B")
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--config", help="a training config: print its memory plan per rank and phase")
    parser.add_argument("--recipe", help="a recipe (preset) to plan, as --config (the config file's base)")
    parser.add_argument("--world-size", type=int, help="ranks the config runs on (with --config)")
    parser.add_argument("--device-gib", type=float, help="device memory per rank, GiB: does the plan fit?")
    parser.add_argument("--samples-per-pack", type=int, default=1, help="text: max_text_len tokens per sample")
    args, overrides = parser.parse_known_args(argv)
    logging.getLogger("megatron").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    if args.config or args.recipe:
        if not args.world_size:
            parser.error("--config / --recipe need --world-size")
        lines = config_plan_lines(
            args.config, overrides, args.world_size, args.device_gib, args.samples_per_pack, args.recipe
        )
        print("\n".join(lines))
        return
    if overrides:
        parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    for preset in args.preset or ["DiT-7B", "DiT-28B"]:
        shapes = parameter_shapes(preset)
        print(f"{preset}: {sum(torch.Size(s).numel() for s in shapes):,d} parameters")
        print(format_rows(memory_rows(preset, shapes, args.dp, args.precision)))


if __name__ == "__main__":
    main()
