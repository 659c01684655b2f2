"""Load a trained DiT for generation: config from the checkpoint, model weights only, one process.

Training saves model, optimizer, RNG and data position; generation needs only the model part.
dist_checkpointing stores global tensor names, so a TP=2 / PP=2 checkpoint reshards into the
single-process (TP=1, PP=1) model built here.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
from megatron.core import dist_checkpointing

from dfm.checkpoint.errors import CheckpointError
from dfm.checkpoint.select import resolve_load_dir
from dfm.checkpoint.state import model_sharded_state_dict, with_weights
from dfm.config.container import ConfigContainer
from dfm.config.loader import apply_mapping, build_config
from dfm.inference.empty_model import empty_model
from dfm.parallel.layout import ParallelLayout

logger = logging.getLogger("dfm.inference")

SINGLE_PROCESS_LAYOUT = dict(
    **ParallelLayout().config_values(),
    recompute_granularity=None,  # no backward pass, nothing to recompute
)


def checkpoint_directory(path: str | Path) -> Path:
    """A checkpoint directory itself, or the one ``<root>/latest`` names."""
    directory = resolve_load_dir(path)
    if directory is None:
        raise FileNotFoundError(f"no checkpoint at {path}: expected an iter_N directory or a root with 'latest'")
    return directory


def checkpoint_config(directory: Path) -> ConfigContainer:
    """The training config saved in the checkpoint's common state (else the root's config.yaml)."""
    common = dist_checkpointing.load_common_state_dict(str(directory))
    if isinstance(common, dict) and common.get("config"):
        cfg = ConfigContainer()
        apply_mapping(cfg, common["config"])
        return cfg
    yaml_file = directory.parent / "config.yaml"
    if yaml_file.is_file():
        return build_config(None, str(yaml_file))
    raise FileNotFoundError(f"{directory} holds no 'config' in its common state and {yaml_file} does not exist")


def single_process_config(cfg: ConfigContainer) -> ConfigContainer:
    """A copy of ``cfg`` whose model runs unsharded in one process (TP = PP = CP = EP = 1)."""
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **SINGLE_PROCESS_LAYOUT))


def load_model(
    cfg: ConfigContainer, directory: Path, device: torch.device, use_ema: bool = True, prepare=None
) -> torch.nn.Module:
    """Build the (TP=1, PP=1) model of ``cfg`` and fill it with the checkpoint's weights; eval mode.
    ``prepare(model)`` runs on the empty model first (a LoRA run's adapters: dfm.convert.lora.adapters_of).

    The EMA weights replace the trained ones when the checkpoint has them and ``use_ema``.
    Needs megatron's parallel state initialised (``initialize_distributed()``).
    """
    # Built on meta and given uninitialised storage: every parameter is loaded below (strict), so no random
    # init runs and the weights are held once.
    model, _ = empty_model(cfg.model, cfg.mixed_precision.precision, device, cast=True)
    if prepare is not None:
        prepare(model)
    elif cfg.peft.enabled:  # loading it without its adapters would silently give the base model
        raise CheckpointError(
            f"{directory} is a LoRA run's checkpoint (peft.lora_rank={cfg.peft.lora_rank}): merge it first with "
            "convert_<family>.py export --merge-lora and import that, or load its adapters in diffusers (docs/lora.md)"
        )
    # Only the model part is requested: optimizer, RNG and data states stay on disk.
    request = {"model0": model_sharded_state_dict(model)}
    with_ema = use_ema and bool(dist_checkpointing.load_common_state_dict(str(directory)).get("has_ema"))
    if with_ema:
        fp32 = {name: torch.empty_like(p, dtype=torch.float32) for name, p in model.named_parameters()}
        request["ema0"] = with_weights(request["model0"], fp32)
    loaded = dist_checkpointing.load(request, str(directory))
    model.load_state_dict(loaded["model0"], strict=True)
    if with_ema:
        model.load_state_dict(loaded["ema0"], strict=False)
    logger.info("loaded %s weights from %s", "EMA" if with_ema else "model", directory)
    return model.eval().requires_grad_(False)
