"""``convert_<family>.py import|export``: a published model's diffusers folder to a dfm checkpoint and back.

    import --diffusers DIR --output CKPT [--recipe NAME] [--verify] [--overwrite] [key=value ...]
    export --checkpoint CKPT --output DIR [--ema] [--dtype bf16|fp32] [--overwrite] [--merge-lora]
    export-lora --checkpoint CKPT --output DIR [--ema] [--dtype bf16|fp32] [--overwrite]

DIR is a model folder or a pipeline folder (its ``transformer/``). Both directions read and write one
tensor at a time into a model built on meta, and write into a fresh folder next to the output that
replaces it only when complete.

A family (``dfm/convert/wan.py``, ``flux.py``) supplies the config translation, the rules and the
parity check; everything else (reading, writing, checkpoints) is shared here.
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from dfm.config.container import ConfigContainer, ModelConfig
from dfm.config.loader import apply_overrides, set_key
from dfm.config.recipes import get_recipe
from dfm.config.validate import validate_config
from dfm.convert.diffusers_folder import DiffusersWeights, read_config, write_diffusers_folder_streaming
from dfm.convert.lora import base_or_merged, export_lora
from dfm.convert.output_folder import check_target, diffusers_folder_problem, fresh_folder, weights_only_root_problem
from dfm.convert.pretrained import read_checkpoint_weights, save_pretrained_checkpoint
from dfm.convert.rules import ConversionError, Rule, check_keys, convert_stream
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
    # (diffusers folder, cfg, () -> the dfm weights as (name, tensor) pairs) -> max abs diff of dfm vs
    # diffusers on random packed inputs
    verify: Callable[[str, ConfigContainer, Callable[[], Iterable[tuple[str, Tensor]]]], float]


def import_config(family: Family, diffusers_config: dict, recipe: str | None, overrides: Sequence[str]):
    """Recipe (or defaults) -> the diffusers config's model keys -> the user's overrides; validated."""
    cfg = get_recipe(recipe) if recipe else ConfigContainer()
    set_key(cfg, "model.architecture", family.architecture)
    for key, value in family.model_overrides(diffusers_config).items():
        set_key(cfg, key, value)
    apply_overrides(cfg, overrides)
    validate_config(cfg)
    return cfg


# --dtype values and the torch dtypes they name; the import records its source's under IMPORTED_DTYPE.
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
IMPORTED_DTYPE = "imported_dtype"


def dtype_name(dtype: torch.dtype) -> str:
    return next((name for name, value in DTYPES.items() if value == dtype), str(dtype).removeprefix("torch."))


def warn_if_narrowed(imported: torch.dtype, precision: str) -> None:
    if imported.itemsize > DTYPES[precision].itemsize:
        logger.warning("%s weights stored at %s: an export will not give them back exactly", imported, precision)


def import_model(family: Family, args: argparse.Namespace) -> Path:
    """The diffusers folder's tensors, read one rule at a time, into a checkpoint that replaces --output whole."""
    cfg = import_config(family, read_config(args.diffusers, family.diffusers_class), args.recipe, args.overrides)
    source = DiffusersWeights(args.diffusers)
    rules = family.rules(cfg.model)

    def weights():
        return convert_stream(source.read, source.names(), rules, "diffusers", str(source.folder))

    check_keys(source.names(), rules, "diffusers", str(source.folder))  # before anything is written
    target = Path(args.output)
    check_target(target, args.overwrite, weights_only_root_problem)
    imported = source.main_dtype()
    warn_if_narrowed(imported, cfg.mixed_precision.precision)
    with fresh_folder(target) as staging:
        written = save_pretrained_checkpoint(cfg, weights(), staging, {IMPORTED_DTYPE: dtype_name(imported)})
    gc.collect()  # the model's cycles: its memory goes before --verify builds two more
    directory = target / written.name
    print(f"wrote {directory}: {len(rules)} tensors; train from it with checkpoint.pretrained={args.output}")
    if args.verify:
        print(VERIFY_LINE.format(family.verify(args.diffusers, cfg, weights)))
    return directory


def diffusers_config_of(family: Family, model_cfg: ModelConfig) -> dict:
    import diffusers

    return {"_class_name": family.diffusers_class, "_diffusers_version": diffusers.__version__} | (
        family.diffusers_config(model_cfg)
    )


def export_dtype(requested: str | None, common: dict, weights: dict[str, Tensor]) -> torch.dtype:
    """--dtype, else the dtype the import recorded, else the checkpoint's (its model precision)."""
    name = requested or common.get(IMPORTED_DTYPE)
    return DTYPES[name] if name in DTYPES else next(iter(weights.values())).dtype


def export_model(family: Family, args: argparse.Namespace) -> Path:
    """The checkpoint's model, split one rule at a time into a diffusers folder that replaces --output whole."""
    target = Path(args.output)
    check_target(target, args.overwrite, diffusers_folder_problem)
    cfg, common, weights = read_export_weights(family, args)
    with fresh_folder(target) as staging:
        count, dtype = write_export(family, (cfg, common, weights), args, staging)
    loader = f"diffusers.{family.diffusers_class}.from_pretrained"
    print(f"wrote {target}: {count} {dtype_name(dtype)} tensors; load it with {loader}")
    return target


def read_export_weights(family: Family, args: argparse.Namespace) -> tuple[ConfigContainer, dict, dict]:
    """--checkpoint's (config, common state, {global name: full tensor}) of a ``family`` model."""
    cfg, common, weights = read_checkpoint_weights(args.checkpoint, use_ema=args.ema)
    if cfg.model.architecture != family.architecture:
        raise ConversionError(
            f"{args.checkpoint} holds a model.architecture={cfg.model.architecture} model, not {family.architecture}"
        )
    return cfg, common, weights


def write_export(family: Family, read: tuple, args: argparse.Namespace, folder: Path) -> tuple[int, torch.dtype]:
    """``read`` = (config, common state, weights) of a checkpoint -> a diffusers model folder; -> (tensors, dtype)."""
    cfg, common, weights = read
    weights = base_or_merged(weights, cfg, args.merge_lora, str(args.checkpoint))
    dtype, rules, source = export_dtype(args.dtype, common, weights), family.rules(cfg.model), str(args.checkpoint)
    shapes = {name: torch.empty(tensor.shape, dtype=dtype, device="meta") for name, tensor in weights.items()}
    plan = {name: (dtype, tuple(t.shape)) for name, t in convert_stream(shapes.get, shapes, rules, "dfm", source)}
    tensors = ((name, t.to(dtype)) for name, t in convert_stream(weights.get, weights, rules, "dfm", source))
    write_diffusers_folder_streaming(folder, diffusers_config_of(family, cfg.model), plan, tensors)
    return len(plan), dtype


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
