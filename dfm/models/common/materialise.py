"""A model built on the meta device, given memory only for what this rank owns.

Without Megatron-FSDP a rank owns its TP/PP-local parameters: ``materialise_`` allocates them on the
target device, then ``init_params`` fills them chunk by chunk. Under Megatron-FSDP it owns rows of
them: ``defer_to_fsdp`` lets Megatron-FSDP allocate its sharded buffers from the meta model
(``init_model_with_meta_device``: it materialises one module at a time and keeps this rank's rows),
then ``init_fsdp_shards`` draws exactly those rows into the main weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dfm.models.common.init import (
    DECLARED_INIT,
    InitialValue,
    fill_initial,
    full_shape,
    mark_tensor_parallel_weights,
    tensor_split,
)
from dfm.parallel.fsdp_shards import (
    inner_model,
    named_parameters,
    row_range,
    tp_local_shape,
)


def materialise_(model: nn.Module, device: torch.device) -> nn.Module:
    """Replace every meta parameter by an uninitialised one on ``device``, keeping its attributes
    (TP split, declared init, ...) and its ties: one allocation per parameter, nothing else."""
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) not in done:
                done[id(param)] = _empty_like(param, device)
            setattr(module, name, done[id(param)])
    meta_buffers = [name for name, buffer in model.named_buffers() if buffer.is_meta]
    if meta_buffers:
        raise NotImplementedError(f"buffers built on the meta device have no values to materialise: {meta_buffers}")
    return model


def _empty_like(param: nn.Parameter, device: torch.device) -> nn.Parameter:
    empty = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
    empty.__dict__.update(param.__dict__)
    return empty


def defer_to_fsdp(model: nn.Module) -> nn.Module:
    """Prepare a meta model for Megatron-FSDP's ``init_model_with_meta_device``, which gives every
    module that owns parameters new (uninitialised) ones on the device and calls its
    ``reset_parameters``: ours copies the old parameters' attributes onto the new ones (torch's
    ``to_empty`` drops them) and draws nothing; ``init_fsdp_shards`` fills the rows afterwards."""
    mark_tensor_parallel_weights(model)
    for module in model.modules():
        old = dict(module.named_parameters(recurse=False))
        if old:
            module.reset_parameters = _AttributeRestorer(module, old)
    return model


class _AttributeRestorer:
    """``module.reset_parameters`` under Megatron-FSDP's meta-device init (see ``defer_to_fsdp``)."""

    def __init__(self, module: nn.Module, old: dict[str, nn.Parameter]):
        self.module, self.old = module, old

    def __call__(self) -> None:
        for name, param in self.module.named_parameters(recurse=False):
            for key, value in vars(self.old[name]).items():
                if not hasattr(param, key):
                    setattr(param, key, value)
        self.old = {}  # the meta parameters are no longer needed


@torch.no_grad()
def init_fsdp_shards(chunk, seed: int, global_name: Callable[[str], str], std: float) -> None:
    """Fill a Megatron-FSDP chunk's main weights, this rank's rows of each TP-local parameter only,
    with the values ``init_params`` gives the unsharded model (rounded through the model's dtype,
    as a low-precision model's main weights are), then copy them into the model weights."""
    for name, shard in named_parameters(chunk):
        model_param, local = shard.orig_param, shard.to_local()
        assert list(tp_local_shape(shard)) == list(model_param.shape), name
        first, count, _ = row_range(shard)  # collective: before skipping a rank that holds no rows
        rows = range(first, first + count)
        if local.numel() == 0:
            continue
        declared = getattr(model_param, DECLARED_INIT, None)
        split = tensor_split(model_param)
        value = InitialValue(global_name(name), declared, full_shape(model_param), seed, std)
        fill_initial(local, value, split, rows, model_param.dtype)
    _install_initial_weights(chunk.module)
    for module in inner_model(chunk).modules():
        if isinstance(module.__dict__.get("reset_parameters"), _AttributeRestorer):
            del module.reset_parameters


def _install_initial_weights(fsdp) -> None:
    """Main weights -> model weights, leaving the module holding its DTensor shards, the state the
    optimizer is built from. Sharded model weights are gathered by each unit's forward; replicated
    ones (strategies ``optim``, ``optim_grads``) are all-gathered here, into their own buffers."""
    fsdp.install_optimized_model_weights()
    groups = fsdp.param_and_grad_buffer.parameter_groups
    if any(g.model_weight_buffer is not None and not g.model_weight_buffer.is_data_distributed for g in groups):
        fsdp.start_param_sync(force_sync=True)
        fsdp.synchronize_param_gather()
