"""``convert_<family>.py import|export``: a published model's diffusers folder to a dfm checkpoint and back.

    import --diffusers DIR --output CKPT [--recipe NAME] [--verify] [--overwrite] [key=value ...]
    export --checkpoint CKPT --output DIR [--ema] [--dtype bf16|fp32] [--overwrite] [--merge-lora]
    export-lora --checkpoint CKPT --output DIR [--ema] [--dtype bf16|fp32] [--overwrite]

DIR is a model folder or a pipeline folder (its ``transformer/``). The command line of one family
(``Family``, family.py: ``WAN`` in wan.py, ``FLUX`` in flux.py, ...) over the shared import and export
(import_export.py); Wan 2.2's two-expert folders add their own commands on top (wan_experts.py).
"""

from __future__ import annotations

import argparse
import functools
import logging
from collections.abc import Callable, Sequence

from dfm.convert.family import Family
from dfm.convert.import_export import DTYPES, export_lora, export_model, import_model
from dfm.convert.rules import ConversionError
from dfm.errors import ConfigError
from dfm.parallel.layout import ParallelLayout

# The converters' TP and PP size flags, named as their config keys.
RECORDED_SIZES = tuple(ParallelLayout.key(name).removeprefix("model.") for name in ("tp", "pp"))


def export_arguments(command: argparse.ArgumentParser, output: str, dtype: str) -> None:
    """What ``export`` and ``export-lora`` read and write."""
    command.add_argument("--checkpoint", required=True, help="an iter_N directory or a root")
    command.add_argument("--output", required=True, help=output)
    command.add_argument("--ema", action="store_true", help="export the EMA weights (when the checkpoint has them)")
    command.add_argument("--overwrite", action="store_true", help="replace an earlier export at --output")
    command.add_argument("--dtype", choices=sorted(DTYPES), help=dtype)


def parser_for(family: Family) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=f"{family.diffusers_class} weights <-> dfm checkpoints")
    commands = parser.add_subparsers(dest="command", required=True)
    imp = commands.add_parser("import", help="a diffusers folder -> a dfm checkpoint (checkpoint.pretrained=...)")
    imp.add_argument("--diffusers", required=True, help="the model folder, or a pipeline folder with transformer/")
    imp.add_argument("--output", required=True, help="checkpoint root to write")
    imp.add_argument("--recipe", help="base recipe (e.g. the published model's); the diffusers config sets the model")
    imp.add_argument("--verify", action="store_true", help="run diffusers and dfm on random packed inputs")
    imp.add_argument("--overwrite", action="store_true", help="replace an earlier import at --output (never a run)")
    for size in RECORDED_SIZES:
        # dfm checkpoints reshard on load: the sizes are only recorded in the saved config.
        imp.add_argument(f"--{size}", type=int, help="recorded in the checkpoint's config; any layout loads it")
    imp.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. mixed_precision.precision=bf16")
    exp = commands.add_parser("export", help="a dfm checkpoint (any layout) -> a diffusers folder")
    export_arguments(exp, "folder to write", "default: the dtype the imported model had")
    exp.add_argument("--merge-lora", action="store_true", help="a LoRA run's checkpoint: base + adapters merged")
    lora = commands.add_parser("export-lora", help="a LoRA run's adapters -> a diffusers LoRA file (docs/lora.md)")
    export_arguments(lora, "folder to write pytorch_lora_weights.safetensors into", "default: the adapters' dtype")
    return parser


def main(
    family: Family, argv: Sequence[str] | None = None, run: Callable[[argparse.Namespace], object] | None = None
) -> int:
    """``run``: what the parsed command does (None: this family's import or export; Wan 2.2's
    two-expert folders pass their own, dfm/convert/wan_experts.py)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parser_for(family).parse_args(argv)
    if args.command == "import":
        args.overrides = list(args.overrides) + [
            f"model.{size}={getattr(args, size)}" for size in RECORDED_SIZES if getattr(args, size)
        ]
    commands = {"import": import_model, "export": export_model, "export-lora": export_lora}
    if run is None:
        run = functools.partial(commands[args.command], family)
    try:
        run(args)
    except (ConversionError, ConfigError, FileNotFoundError) as error:
        print(f"error: {error}")
        return 2
    return 0
