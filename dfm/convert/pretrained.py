"""Full weights under global names <-> dfm checkpoints, in one process: dfm's end of import and export."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from megatron.core import dist_checkpointing
from torch import Tensor

from dfm.checkpoint.weights_only import save_weights_only
from dfm.config.container import ConfigContainer
from dfm.config.loader import config_to_dict
from dfm.convert.lora import adapters_of
from dfm.convert.weights import fill_params, single_process_world
from dfm.inference.checkpoint_loading import checkpoint_config, checkpoint_directory, load_model, single_process_config
from dfm.inference.empty_model import empty_model


def save_pretrained_checkpoint(
    cfg: ConfigContainer,
    weights: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]],
    path: str | Path,
    extra: dict | None = None,
) -> Path:
    """A weights-only dfm checkpoint under root ``path`` (loads at any layout); returns its directory.

    ``weights``: a dict, or (global name, tensor) pairs read one at a time into a model built on meta, so
    the model's bytes are held once. The saved config is ``cfg`` as given (its parallel sizes are only a
    record: any layout loads it); ``extra``: plain values for the common state.
    """
    built = single_process_config(cfg)
    with single_process_world(cfg.rng.seed):
        model, _ = empty_model(built.model, built.mixed_precision.precision)
        fill_params(model, weights.items() if isinstance(weights, Mapping) else weights, "the converted weights")
        return save_weights_only(path, [model], config_to_dict(cfg), extra)


def read_checkpoint_weights(path: str | Path, use_ema: bool = False) -> tuple[ConfigContainer, dict, dict[str, Tensor]]:
    """Any dfm checkpoint (training or weights-only, any layout) -> (its config, its common state,
    {global name: full tensor}); the tensors are the loaded model's own, held once."""
    directory = checkpoint_directory(path)
    cfg = checkpoint_config(directory)
    single = single_process_config(cfg)
    with single_process_world(cfg.rng.seed):
        model = load_model(single, directory, torch.device("cpu"), use_ema=use_ema, prepare=adapters_of(single))
        weights = {model.global_param_name(name): p.detach() for name, p in model.named_parameters()}
    return cfg, dist_checkpointing.load_common_state_dict(str(directory)), weights


def read_full_weights(path: str | Path, use_ema: bool = False) -> tuple[ConfigContainer, dict[str, Tensor]]:
    """Any dfm checkpoint (training or weights-only, any layout) -> (its config, {global name: full tensor})."""
    cfg, _, weights = read_checkpoint_weights(path, use_ema)
    return cfg, weights
