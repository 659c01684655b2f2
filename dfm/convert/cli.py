"""``convert_<family>.py import|export``: a published model's diffusers folder to a dfm checkpoint and back.

    import --diffusers DIR --output CKPT [--recipe NAME] [--verify] [key=value ...]
    export --checkpoint CKPT --output DIR [--ema]

A family (``dfm/convert/wan.py``, ``flux.py``) supplies the config translation, the rules and the
parity check; everything else (reading, writing, checkpoints) is shared here.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from dfm.config.container import ConfigContainer, ModelConfig
from dfm.config.loader import apply_overrides, set_key
from dfm.config.recipes import get_recipe
from dfm.config.validate import validate_config
from dfm.convert.diffusers_folder import model_folder, read_diffusers_folder, write_diffusers_folder
from dfm.convert.pretrained import read_full_weights, save_pretrained_checkpoint
from dfm.convert.rules import ConversionError, Rule, to_dfm, to_diffusers
from dfm.errors import ConfigError
from dfm.parallel.layout import ParallelLayout

logger = logging.getLogger("dfm.convert")

# The converters' TP and PP size flags, named as their config keys.
RECORDED_SIZES = tuple(ParallelLayout.key(name).removeprefix("model.") for name in ("tp", "pp"))
VERIFY_LINE = "max abs diff vs diffusers: {:.3g}"


@dataclass(frozen=True)
class Family:
    """What differs between published models; see the module docstring."""

    architecture: str  # model.architecture value
    diffusers_class: str  # attribute of the diffusers package, e.g. "WanTransformer3DModel"
    model_overrides: Callable[[dict], dict]  # diffusers config.json -> {"model.<key>": value}
    diffusers_config: Callable[[ModelConfig], dict]  # the config.json an export writes
    rules: Callable[[ModelConfig], list[Rule]]
    # (diffusers folder, cfg, dfm full weights) -> max abs diff of dfm vs diffusers on random packed inputs
    verify: Callable[[str, ConfigContainer, dict[str, Tensor]], float]


def import_config(family: Family, diffusers_config: dict, recipe: str | None, overrides: Sequence[str]):
    """Recipe (or defaults) -> the diffusers config's model keys -> the user's overrides; validated."""
    cfg = get_recipe(recipe) if recipe else ConfigContainer()
    set_key(cfg, "model.architecture", family.architecture)
    for key, value in family.model_overrides(diffusers_config).items():
        set_key(cfg, key, value)
    apply_overrides(cfg, overrides)
    validate_config(cfg)
    return cfg


def import_model(family: Family, args: argparse.Namespace) -> Path:
    config, state = read_diffusers_folder(args.diffusers)
    cfg = import_config(family, config, args.recipe, args.overrides)
    weights = to_dfm(state, family.rules(cfg.model), source=str(model_folder(args.diffusers)))
    directory = save_pretrained_checkpoint(cfg, weights, args.output)
    print(f"wrote {directory}: {len(weights)} tensors; train from it with checkpoint.pretrained={args.output}")
    if args.verify:
        print(VERIFY_LINE.format(family.verify(args.diffusers, cfg, weights)))
    return directory


def diffusers_config_of(family: Family, model_cfg: ModelConfig) -> dict:
    import diffusers

    return {"_class_name": family.diffusers_class, "_diffusers_version": diffusers.__version__} | (
        family.diffusers_config(model_cfg)
    )


def export_model(family: Family, args: argparse.Namespace) -> Path:
    cfg, weights = read_full_weights(args.checkpoint, use_ema=args.ema)
    if cfg.model.architecture != family.architecture:
        raise ConversionError(
            f"{args.checkpoint} holds a model.architecture={cfg.model.architecture} model, not {family.architecture}"
        )
    state = to_diffusers(weights, family.rules(cfg.model), source=str(args.checkpoint))
    folder = write_diffusers_folder(args.output, diffusers_config_of(family, cfg.model), state)
    print(f"wrote {folder}: {len(state)} tensors; load it with diffusers.{family.diffusers_class}.from_pretrained")
    return folder


def parser_for(family: Family) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=f"{family.diffusers_class} weights <-> dfm checkpoints")
    commands = parser.add_subparsers(dest="command", required=True)
    imp = commands.add_parser("import", help="a diffusers folder -> a dfm checkpoint (checkpoint.pretrained=...)")
    imp.add_argument("--diffusers", required=True, help="the model folder, or a pipeline folder with transformer/")
    imp.add_argument("--output", required=True, help="checkpoint root to write")
    imp.add_argument("--recipe", help="base recipe (e.g. the published model's); the diffusers config sets the model")
    imp.add_argument("--verify", action="store_true", help="run diffusers and dfm on random packed inputs")
    for size in RECORDED_SIZES:
        # dfm checkpoints reshard on load: the sizes are only recorded in the saved config.
        imp.add_argument(f"--{size}", type=int, help="recorded in the checkpoint's config; any layout loads it")
    imp.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. mixed_precision.precision=bf16")
    exp = commands.add_parser("export", help="a dfm checkpoint (any layout) -> a diffusers folder")
    exp.add_argument("--checkpoint", required=True, help="an iter_N directory or a root")
    exp.add_argument("--output", required=True, help="folder to write")
    exp.add_argument("--ema", action="store_true", help="export the EMA weights (when the checkpoint has them)")
    return parser


def main(family: Family, argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parser_for(family).parse_args(argv)
    if args.command == "import":
        args.overrides = list(args.overrides) + [
            f"model.{size}={getattr(args, size)}" for size in RECORDED_SIZES if getattr(args, size)
        ]
    try:
        (import_model if args.command == "import" else export_model)(family, args)
    except (ConversionError, ConfigError, FileNotFoundError) as error:
        print(f"error: {error}")
        return 2
    return 0
