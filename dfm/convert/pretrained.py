"""Full weights under global names <-> dfm checkpoints, in one process: dfm's end of import and export."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from megatron.core import dist_checkpointing
from torch import Tensor

from dfm.checkpoint.weights_only import save_weights_only
from dfm.config.container import ConfigContainer
from dfm.config.loader import config_to_dict
from dfm.convert.lora import adapters_of
from dfm.convert.rules import ConversionError
from dfm.inference.checkpoint_loading import checkpoint_config, checkpoint_directory, load_model, single_process_config
from dfm.inference.empty_model import empty_model


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
def fill_params(model: torch.nn.Module, tensors: Iterable[tuple[str, Tensor]], source: str) -> None:
    """Copy each (global name, full tensor) into the unsharded ``model`` as it comes (cast to the
    parameter's dtype); every parameter must come exactly once, with its shape."""
    params = {model.global_param_name(name): param for name, param in model.named_parameters()}
    filled: set[str] = set()
    for name, tensor in tensors:
        if name not in params or name in filled:
            raise ConversionError(f"{source}: {name} is {'given twice' if name in filled else 'not in the model'}")
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise ConversionError(
                f"{source}: {name} has shape {tuple(tensor.shape)}, the model {tuple(params[name].shape)}"
            )
        params[name].copy_(tensor)
        filled.add(name)
    missing = sorted(set(params) - filled)
    if missing:
        raise ConversionError(f"{source} does not fit the model: missing {missing[:8]} ({len(missing)})")


def fill_weights(model: torch.nn.Module, weights: dict[str, Tensor], source: str) -> None:
    """Copy ``weights`` {global name: full tensor} into the unsharded ``model``; names and shapes must match."""
    params = {model.global_param_name(name) for name, _ in model.named_parameters()}
    missing, unused = sorted(params - set(weights)), sorted(set(weights) - params)
    if missing or unused:
        raise ConversionError(
            f"{source} does not fit the model: missing {missing[:8]} ({len(missing)}), "
            f"not in the model {unused[:8]} ({len(unused)})"
        )
    fill_params(model, weights.items(), source)


@contextlib.contextmanager
def converted_model(
    model_cfg, weights: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]], seed: int
) -> Iterator[torch.nn.Module]:
    """The unsharded fp32 model of ``model_cfg`` holding ``weights`` (a dict, or (name, tensor) pairs read
    one at a time), in eval mode, without autograd; built on meta, so no random model exists first."""
    with single_process_world(seed):
        model, _ = empty_model(model_cfg, "fp32")
        fill_params(model, weights.items() if isinstance(weights, Mapping) else weights, "the converted weights")
        with torch.no_grad():
            yield model.eval()


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
