"""Full weights under global names <-> dfm checkpoints, in one process: dfm's end of import and export."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from dfm.checkpoint.weights_only import save_weights_only
from dfm.config.container import ConfigContainer
from dfm.config.loader import config_to_dict
from dfm.convert.rules import ConversionError
from dfm.inference.checkpoint_loading import checkpoint_config, checkpoint_directory, load_model, single_process_config
from dfm.models.build import build_model


@contextlib.contextmanager
def single_process_world(seed: int) -> Iterator[None]:
    """megatron's parallel state for one process (TP = PP = CP = 1), unless the caller started one already."""
    if torch.distributed.is_initialized():
        yield
        return
    from dfm.platform.distributed import destroy_distributed, initialize_distributed

    initialize_distributed(seed=seed)
    try:
        yield
    finally:
        destroy_distributed()


@torch.no_grad()
def fill_weights(model: torch.nn.Module, weights: dict[str, Tensor], source: str) -> None:
    """Copy ``weights`` {global name: full tensor} into the unsharded ``model``; names and shapes must match."""
    params = {model.global_param_name(name): param for name, param in model.named_parameters()}
    missing, unused = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
    if missing or unused:
        raise ConversionError(
            f"{source} does not fit the model: missing {missing[:8]} ({len(missing)}), "
            f"not in the model {unused[:8]} ({len(unused)})"
        )
    for name, param in params.items():
        if tuple(weights[name].shape) != tuple(param.shape):
            raise ConversionError(
                f"{source}: {name} has shape {tuple(weights[name].shape)}, the model {tuple(param.shape)}"
            )
        param.copy_(weights[name])


@contextlib.contextmanager
def converted_model(model_cfg, weights: dict[str, Tensor], seed: int) -> Iterator[torch.nn.Module]:
    """The unsharded fp32 model of ``model_cfg`` holding ``weights``, in eval mode, without autograd."""
    with single_process_world(seed):
        model, _ = build_model(model_cfg, "fp32", device="cpu")  # checked on the CPU, whatever the host
        fill_weights(model, {name: w.float() for name, w in weights.items()}, "the converted weights")
        with torch.no_grad():
            yield model.eval()


def save_pretrained_checkpoint(cfg: ConfigContainer, weights: dict[str, Tensor], path: str | Path) -> Path:
    """A weights-only dfm checkpoint under root ``path`` (loads at any layout); returns its directory.

    The saved config is ``cfg`` as given (its parallel sizes are only a record: any layout loads it).
    """
    built = single_process_config(cfg)
    with single_process_world(cfg.rng.seed):
        model, _ = build_model(built.model, built.mixed_precision.precision, device="cpu")
        fill_weights(model, weights, "the converted weights")
        return save_weights_only(path, [model], config_to_dict(cfg))


def read_full_weights(path: str | Path, use_ema: bool = False) -> tuple[ConfigContainer, dict[str, Tensor]]:
    """Any dfm checkpoint (training or weights-only, any layout) -> (its config, {global name: full tensor})."""
    directory = checkpoint_directory(path)
    cfg = checkpoint_config(directory)
    single = single_process_config(cfg)
    with single_process_world(cfg.rng.seed):
        model = load_model(single, directory, torch.device("cpu"), use_ema=use_ema)
        weights = {model.global_param_name(name): p.detach().clone() for name, p in model.named_parameters()}
    return cfg, weights
