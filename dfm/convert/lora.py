"""LoRA runs through the converters: the family rules the adapters are named by, ``export-lora`` and
``export --merge-lora`` (dfm/peft holds the adapters themselves; docs/lora.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

from torch import Tensor

from dfm.config.peft import is_adapter_param
from dfm.convert.rules import ConversionError, Rule


def family_rules(model_cfg) -> list[Rule] | None:
    """The conversion rules of a family with a diffusers counterpart (its LoRA targets are diffusers
    names), None for the others (targets are dfm's module names)."""
    if model_cfg.architecture == "wan":
        from dfm.convert.wan import rules

        return rules(model_cfg)
    if model_cfg.architecture == "flux":
        from dfm.convert.flux import flux_rules

        return flux_rules(model_cfg)
    return None


def adapters_of(cfg):
    """For ``load_model``: puts a LoRA run's adapters on the empty model before its checkpoint loads
    (None when ``cfg`` trains no adapters)."""
    if not cfg.peft.enabled:
        return None
    from dfm.peft.inject import add_lora

    return lambda model: add_lora(model, cfg.peft, cfg.model, family_rules(cfg.model), cfg.rng.seed)


def base_or_merged(weights: dict[str, Tensor], cfg, merge: bool, source: str) -> dict[str, Tensor]:
    """What ``export`` converts: ``weights`` as they are, or with the adapters merged (``--merge-lora``);
    a LoRA checkpoint without ``--merge-lora`` is refused (its adapters have no diffusers model key)."""
    if merge:
        from dfm.peft.export import merged_weights

        return merged_weights(weights, cfg.model, cfg.peft, family_rules(cfg.model))
    if any(is_adapter_param(name) for name in weights):
        raise ConversionError(f"{source} holds LoRA adapters: export --merge-lora for a merged model, or export-lora")
    return weights


def lora_files(cfg, weights: dict[str, Tensor]) -> list[tuple[str, dict[str, Tensor], str]]:
    """(subfolder of the output, its model's weights, the diffusers call that loads it) per LoRA file: one,
    or for Wan 2.2 experts each expert's into its own transformer (dfm/convert/wan_experts.py)."""
    if cfg.model.architecture == "wan" and cfg.model.wan_expert is not None:
        from dfm.convert.wan_experts import expert_lora_files

        return expert_lora_files(cfg.model.wan_expert, weights)
    return [("", weights, 'pipeline.load_lora_weights("{}")')]


def lora_folder_problem(folder: Path) -> str | None:
    """None when ``folder`` holds only what ``export-lora`` writes (so ``--overwrite`` may replace it):
    safetensors files, or subfolders of them (a both-run's transformer/, transformer_2/)."""
    from dfm.convert.output_folder import diffusers_folder_problem

    for entry in sorted(folder.iterdir()):
        if entry.is_dir():
            problem = diffusers_folder_problem(entry)
        else:
            problem = None if entry.name.endswith(".safetensors") else "a file export-lora does not write"
        if problem:
            return f"holds {entry.name}: {problem}"
    return None


def export_lora(family, args: argparse.Namespace) -> Path:
    """``export-lora``: the checkpoint's adapters -> ``<output>/pytorch_lora_weights.safetensors`` (a run of
    both Wan 2.2 experts: ``<output>/transformer/`` and ``<output>/transformer_2/``, one file each)."""
    from dfm.convert.cli import DTYPES, dtype_name
    from dfm.convert.output_folder import check_target, fresh_folder
    from dfm.convert.pretrained import read_checkpoint_weights
    from dfm.peft.export import FILE_NAME, lora_state_dict, write_lora_file

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
