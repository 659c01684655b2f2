"""Wan 2.2 A14B pipeline folders <-> one dfm checkpoint per expert (docs/wan.md).

A14B's pipeline folder holds two transformers and the boundary between them in model_index.json:
``transformer/`` (the high-noise expert, t >= boundary_ratio), ``transformer_2/`` (the low-noise
one). ``import`` of such a folder writes ``OUTPUT/high_noise`` and ``OUTPUT/low_noise``, each a
checkpoint whose config names its expert (``model.wan_expert``) and the boundary, so
``checkpoint.pretrained=OUTPUT/high_noise`` fine-tunes that expert on its side of the boundary.
``export --checkpoint HIGH --checkpoint_2 LOW`` writes the two back as a pipeline folder that
``WanPipeline.from_pretrained`` (I2V experts: ``WanImageToVideoPipeline``) reads (the text encoder, tokenizer, VAE and scheduler are not
written: pass them, or None, to from_pretrained, or copy their folders from the original).
``export --checkpoint BOTH`` of a run of both experts (``model.wan_expert=both``, parameters
``high_noise.*`` and ``low_noise.*``) writes the same folder. Every other folder goes through
the family CLI (dfm/convert/cli.py) unchanged. The experts' folder names and each expert's weights and
LoRA file are the Wan family's (dfm/convert/wan.py).
"""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Sequence
from pathlib import Path

from dfm.convert.cli import main as family_main
from dfm.convert.import_export import export_model, import_model, read_export_weights, write_export
from dfm.convert.output_folder import check_target, fresh_folder
from dfm.convert.rules import ConversionError
from dfm.convert.wan import EXPERT_FOLDERS, WAN, expert_weights
from dfm.inference.checkpoint_loading import checkpoint_config, checkpoint_directory

MODEL_INDEX = "model_index.json"
# The pipeline components an export does not write (listed absent so that WanPipeline loads without them).
ABSENT = ("tokenizer", "text_encoder", "vae", "scheduler")


def is_two_expert_folder(folder: str | Path) -> bool:
    return (Path(folder) / EXPERT_FOLDERS["low_noise"]).is_dir()


def boundary_ratio(folder: Path) -> float:
    """model_index.json's ``boundary_ratio`` of a two-expert pipeline folder."""
    index = folder / MODEL_INDEX
    try:
        ratio = json.loads(index.read_text()).get("boundary_ratio")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as error:
        raise ConversionError(f"{index}: needed for the experts' boundary_ratio ({error!r})") from error
    if not isinstance(ratio, (int, float)) or not 0 < ratio < 1:
        raise ConversionError(f"{index}: boundary_ratio={ratio!r}, a two-expert folder needs one in (0, 1)")
    return float(ratio)


def import_experts(args: argparse.Namespace) -> list[Path]:
    """Each expert's transformer folder through the family import, into OUTPUT/<expert>."""
    folder, ratio = Path(args.diffusers), boundary_ratio(Path(args.diffusers))
    written = []
    for expert, subfolder in EXPERT_FOLDERS.items():
        one = copy.copy(args)
        one.diffusers, one.output = str(folder / subfolder), str(Path(args.output) / expert)
        one.overrides = [*args.overrides, f"model.wan_expert={expert}", f"model.wan_boundary_ratio={ratio}"]
        written.append(import_model(WAN, one))
    return written


def is_lora_run(checkpoint: str) -> bool:
    """Whether ``checkpoint``'s config trains LoRA adapters (peft.lora_rank > 0)."""
    return checkpoint_config(checkpoint_directory(checkpoint)).peft.enabled


def expert_model(checkpoint: str, expert: str):
    """The ModelConfig recorded in ``checkpoint``, which must be ``expert``'s (with a boundary)."""
    model = checkpoint_config(checkpoint_directory(checkpoint)).model
    if model.wan_expert != expert or model.wan_boundary_ratio is None:
        raise ConversionError(
            f"{checkpoint} holds model.wan_expert={model.wan_expert} (boundary {model.wan_boundary_ratio}), "
            f"not the {expert} expert"
        )
    return model


def export_experts(args: argparse.Namespace, checkpoint_2: str) -> Path:
    """--checkpoint (high noise) and ``checkpoint_2`` (low noise) -> a WanPipeline (or, for I2V experts,
    WanImageToVideoPipeline) folder. --merge-lora merges the adapters of those of the two that hold them
    (a LoRA run of one expert exports with the other's import)."""
    models = [expert_model(args.checkpoint, "high_noise"), expert_model(checkpoint_2, "low_noise")]
    lora = {checkpoint: is_lora_run(checkpoint) for checkpoint in (args.checkpoint, checkpoint_2)}
    if args.merge_lora and not any(lora.values()):
        raise ConversionError(f"--merge-lora: neither {args.checkpoint} nor {checkpoint_2} is a LoRA run's checkpoint")
    kinds = {(m.wan_boundary_ratio, m.wan_image_condition) for m in models}
    if len(kinds) != 1:
        raise ConversionError(
            f"the experts' checkpoints record different (boundary, wan_image_condition) {sorted(kinds)}"
        )
    target = Path(args.output)
    check_target(target, False, lambda _: "an existing folder is never replaced by a two-expert export")
    with fresh_folder(target) as staging:
        for expert, checkpoint in (("high_noise", args.checkpoint), ("low_noise", checkpoint_2)):
            one = copy.copy(args)
            one.checkpoint, one.output = checkpoint, str(staging / EXPERT_FOLDERS[expert])
            one.merge_lora = args.merge_lora and lora[checkpoint]
            export_model(WAN, one)
        write_model_index(staging, models[0])
    return wrote(target, models[0].wan_boundary_ratio)


def pipeline_index(model) -> dict:
    """model_index.json of the experts' pipeline: WanPipeline, or (I2V experts, no image encoder as Wan
    2.2's) WanImageToVideoPipeline; the components not written listed absent."""
    i2v = model.wan_image_condition
    absent = (*ABSENT, "image_encoder", "image_processor") if i2v else ABSENT
    index = {"_class_name": "WanImageToVideoPipeline" if i2v else "WanPipeline"}
    index |= {"boundary_ratio": model.wan_boundary_ratio, "expand_timesteps": False}
    index |= {name: ["diffusers", WAN.diffusers_class] for name in EXPERT_FOLDERS.values()}
    return index | {name: [None, None] for name in absent}


def write_model_index(folder: Path, model) -> None:
    """model_index.json of the experts' ModelConfig ``model`` into ``folder``."""
    (folder / MODEL_INDEX).write_text(json.dumps(pipeline_index(model), indent=2) + "\n")


def wrote(target: Path, ratio: float) -> Path:
    print(f"wrote {target}: transformer/ (high noise), transformer_2/ (low noise), boundary_ratio {ratio}")
    return target


def holds_both_experts(checkpoint: str) -> bool:
    """Whether ``checkpoint`` is a run of both experts (model.wan_expert=both)."""
    try:
        return checkpoint_config(checkpoint_directory(checkpoint)).model.wan_expert == "both"
    except (FileNotFoundError, OSError, ValueError):  # not a checkpoint: the family's export says why
        return False


def export_both(args: argparse.Namespace) -> Path:
    """A checkpoint of both experts (parameters ``high_noise.*``, ``low_noise.*``) -> a WanPipeline folder."""
    target = Path(args.output)
    check_target(target, False, lambda _: "an existing folder is never replaced by a two-expert export")
    cfg, common, weights = read_export_weights(WAN, args)
    with fresh_folder(target) as staging:
        for expert, folder in EXPERT_FOLDERS.items():
            write_export(WAN, (cfg, common, expert_weights(weights, expert)), args, staging / folder)
        write_model_index(staging, cfg.model)
    return wrote(target, cfg.model.wan_boundary_ratio)


def main(argv: Sequence[str] | None = None) -> int:
    """convert_wan.py: two-expert folders here, everything else through the family CLI."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--checkpoint_2", help="export: the low-noise expert's checkpoint (--checkpoint: high noise)")
    known, rest = pre.parse_known_args(argv)
    command = rest[0] if rest else None
    two = known.checkpoint_2 if command == "export" else None
    if command == "import":
        folder = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        folder.add_argument("--diffusers")
        diffusers = folder.parse_known_args(rest)[0].diffusers
        two = diffusers if diffusers and is_two_expert_folder(diffusers) else None
    if command == "export" and two is None:
        folder = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        folder.add_argument("--checkpoint")
        checkpoint = folder.parse_known_args(rest)[0].checkpoint
        if checkpoint and holds_both_experts(checkpoint):
            return family_main(WAN, rest, run=export_both)
    if two is None:
        return family_main(WAN, rest)
    run = import_experts if command == "import" else lambda args: export_experts(args, known.checkpoint_2)
    return family_main(WAN, rest, run=run)
