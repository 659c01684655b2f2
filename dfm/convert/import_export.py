"""One family's diffusers folder -> a dfm checkpoint (``import_model``) and back (``export_model``, with a LoRA
run's adapters merged or refused; ``export_lora``: the adapters alone as a diffusers LoRA file).

Both directions read and write one tensor at a time into a model built on meta, and write into a fresh
folder next to the output that replaces it only when complete (output_folder.py).
"""

from __future__ import annotations

import argparse
import gc
import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from dfm.config.container import ConfigContainer, ModelConfig
from dfm.config.loader import apply_overrides, set_key
from dfm.config.peft import is_adapter_param
from dfm.config.recipes import get_recipe
from dfm.config.validate import validate_config
from dfm.convert.diffusers_folder import DiffusersWeights, read_config, write_diffusers_folder_streaming
from dfm.convert.family import Family
from dfm.convert.lora import family_rules, lora_files
from dfm.convert.output_folder import check_target, diffusers_folder_problem, fresh_folder, weights_only_root_problem
from dfm.convert.pretrained import read_checkpoint_weights, save_pretrained_checkpoint
from dfm.convert.rules import ConversionError, check_keys, convert_stream
from dfm.convert.student_schedule import write_student_schedule
from dfm.convert.wan import EXPERT_FOLDERS
from dfm.peft.export import FILE_NAME, lora_state_dict, merged_weights, write_lora_file

logger = logging.getLogger("dfm.convert")

VERIFY_LINE = "max abs diff vs diffusers: {:.3g}"


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
    write_student_schedule(folder, cfg)
    return len(plan), dtype


def base_or_merged(weights: dict[str, Tensor], cfg, merge: bool, source: str) -> dict[str, Tensor]:
    """What ``export`` converts: ``weights`` as they are, or with the adapters merged (``--merge-lora``);
    a LoRA checkpoint without ``--merge-lora`` is refused (its adapters have no diffusers model key)."""
    if merge:
        return merged_weights(weights, cfg.model, cfg.peft, family_rules(cfg.model))
    if any(is_adapter_param(name) for name in weights):
        raise ConversionError(f"{source} holds LoRA adapters: export --merge-lora for a merged model, or export-lora")
    return weights


def lora_folder_problem(folder: Path) -> str | None:
    """None when ``folder`` holds only what ``export-lora`` writes (so ``--overwrite`` may replace it): its
    ``pytorch_lora_weights.safetensors``, or a both-run's ``transformer/`` and ``transformer_2/`` holding one
    each; else every other file named (another LoRA, a model folder: never deleted)."""
    written = {FILE_NAME, *(f"{sub}/{FILE_NAME}" for sub in EXPERT_FOLDERS.values())}
    foreign = [
        str(path.relative_to(folder)) + ("/" if path.is_dir() else "")
        for path in sorted(folder.rglob("*"))
        if str(path.relative_to(folder)) not in written
        and not (path.is_dir() and not path.is_symlink() and path.name in EXPERT_FOLDERS.values())
    ]
    return f"holds files export-lora does not write: {', '.join(foreign)}" if foreign else None


def export_lora(family, args: argparse.Namespace) -> Path:
    """``export-lora``: the checkpoint's adapters -> ``<output>/pytorch_lora_weights.safetensors`` (a run of
    both Wan 2.2 experts: ``<output>/transformer/`` and ``<output>/transformer_2/``, one file each)."""
    target = Path(args.output)
    check_target(target, args.overwrite, lora_folder_problem)
    cfg, _, weights = read_checkpoint_weights(args.checkpoint, use_ema=args.ema)
    if cfg.model.architecture != family.architecture:
        raise ConversionError(f"{args.checkpoint} holds a {cfg.model.architecture} model, not {family.architecture}")
    files = [
        (folder, lora_state_dict(own, cfg.model, cfg.peft, family_rules(cfg.model)), call)
        for folder, own, call in lora_files(cfg, weights)
    ]
    dtype = DTYPES[args.dtype] if args.dtype else next(iter(files[0][1].values())).dtype
    with fresh_folder(target) as staging:
        for folder, state, _ in files:
            write_lora_file(state, cfg.peft, staging / folder / FILE_NAME, dtype)
    for folder, state, call in files:
        where = target / folder
        print(f"wrote {where / FILE_NAME}: {len(state)} {dtype_name(dtype)} tensors; load it with {call.format(where)}")
    return target
