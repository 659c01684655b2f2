"""Full weights under global names in one unsharded model, in one process: what a family's parity check
runs (``converted_model``) and what the checkpoints of pretrained.py are written from."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import Tensor

from dfm.convert.rules import ConversionError
from dfm.inference.empty_model import empty_model
from dfm.platform.distributed import destroy_distributed, initialize_distributed


@contextlib.contextmanager
def single_process_world(seed: int) -> Iterator[None]:
    """megatron's parallel state for one process (TP = PP = CP = 1), unless the caller started one already."""
    if torch.distributed.is_initialized():
        yield
        return
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
