"""Checkpoint state of Megatron-FSDP chunks, in the distributed optimizer's layout-free format.

Saved exactly as a DDP run with ``ddp.use_distributed_optimizer`` saves (``state.py``): model tensors
under their global names, and the optimizer's ``fully_reshardable`` state (fp32 main weight, Adam's
moments per parameter, in model space). So a checkpoint moves between FSDP and the distributed
optimizer, and across TP / DP sizes, in both directions. Each parameter's FSDP row shards are gathered
to its TP-local tensor for the save; a load reads TP-local tensors and keeps this rank's rows
(``dfm.models.common.fsdp_shards``). Both gather or hold one TP-local copy of the state per rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.utils import to_local_if_dtensor

from dfm.models.common.fsdp_shards import (
    full_tensor,
    gather_rows,
    named_parameters,
    rows_of_this_rank,
    tp_local_shape,
)

MOMENTS = ("exp_avg", "exp_avg_sq")


def is_fsdp(chunk) -> bool:
    return bool(getattr(chunk.ddp_config, "use_megatron_fsdp", False))


def model_state(chunk, model_sharded_state_dict, is_loading: bool) -> dict[str, Any]:
    """The chunk's sharded state dict with TP-local full tensors (gathered from the FSDP rows for a
    save, empty ones to load into)."""
    shards = named_parameters(chunk)
    fulls = {
        name: torch.empty(tp_local_shape(shard), dtype=shard.orig_param.dtype) if is_loading else full_tensor(shard)
        for name, shard in shards
    }
    # megatron reads the shapes from the module's parameters: FSDP's compute weights, whose freed
    # buckets leave them empty between steps; they hold the full tensors while the dict is built.
    # (The flag keeps FSDP's state-dict pre-hook from swapping its DTensor shards in meanwhile.)
    fsdp = chunk.module
    fsdp._replace_param_with_raw_if_needed()
    raw = dict(fsdp.module.named_parameters())
    kept = {name: raw[name].data for name in fulls}
    fsdp.is_param_fsdp_distributed = True
    try:
        for name, full in fulls.items():
            raw[name].data = full
        state = model_sharded_state_dict(fsdp.module)
    finally:
        for name, data in kept.items():
            raw[name].data = data
        fsdp.is_param_fsdp_distributed = False
    for name, full in fulls.items():
        state[name] = dataclasses.replace(state[name], data=full)
    return state


def optimizer_state(model, optimizer, chunk_states: list[dict[str, Any]], is_loading: bool) -> dict[str, Any]:
    """What ``DistributedOptimizer.sharded_state_dict`` gives with ``fully_reshardable``: the common
    state, and per parameter ``optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>`` tensors."""
    state = _adam_state(optimizer)
    param_state = {}
    for chunk, chunk_state in zip(model, chunk_states):
        for name, shard in named_parameters(chunk):
            sharded = chunk_state[name]
            tensors = {"param": shard.to_local(), **{k: _moment(state, shard, k) for k in MOMENTS}}
            param_state[len(param_state)] = {
                key: _like(sharded, f"optimizer.state.{key}.{sharded.key}", shard, local, is_loading)
                for key, local in tensors.items()
            }
    return {**optimizer.state_dict(), "param_state": param_state, "param_state_sharding_type": "fully_reshardable"}


def _like(sharded: ShardedTensor, key: str, shard, local: torch.Tensor, is_loading: bool) -> ShardedTensor:
    """``sharded`` (a model tensor) renamed to ``key``, holding the fp32 TP-local tensor of ``local``'s rows."""
    shape = sharded.data.shape
    data = torch.empty(shape, dtype=torch.float32) if is_loading else gather_rows(shard, local).reshape(shape)
    dtype = {} if isinstance(sharded, ShardedTensorFactory) else {"dtype": torch.float32}
    return dataclasses.replace(sharded, key=key, data=data, **dtype)


def _moment(state: dict, shard, key: str) -> torch.Tensor:
    """This rank's rows of an Adam moment; zeros where Adam never stepped the shard (no rows here)."""
    moment = state.get(shard, {}).get(key)  # not state[shard]: a defaultdict would add an empty state
    return to_local_if_dtensor(moment) if moment is not None else torch.zeros_like(shard.to_local())


def _adam_state(optimizer) -> dict:
    inner = optimizer.optimizer
    if not all(k in state for state in inner.state.values() for k in MOMENTS) or not inner.state:
        raise ValueError("Megatron-FSDP checkpoints hold Adam's state: optimizer.optimizer=adam")
    return inner.state


@torch.no_grad()
def load_model(chunk, loaded: dict[str, Any]) -> None:
    """Keep this rank's rows of each loaded TP-local tensor in the FSDP main-weight shards."""
    for name, shard in named_parameters(chunk):
        shard.to_local().copy_(rows_of_this_rank(shard, loaded[name]).reshape(shard.to_local().shape))


@torch.no_grad()
def load_optimizer(model, optimizer, loaded: dict[str, Any]) -> None:
    """Moments and step from a ``fully_reshardable`` optimizer state (saved by FSDP or the distributed
    optimizer); the main weights come from the same state's ``param`` tensors. Every rank makes the
    same collectives in the same order (a rank without rows of a parameter copies zero rows)."""
    state = _adam_state(optimizer)
    step = loaded["optimizer"]["param_groups"][0]["step"]  # learning rates: the scheduler's state
    index = 0
    for chunk in model:
        for _, shard in named_parameters(chunk):
            tensors = loaded["param_state"][index]
            index += 1
            local = shard.to_local()
            local.copy_(rows_of_this_rank(shard, tensors["param"]).reshape(local.shape))
            for key in MOMENTS:
                target = to_local_if_dtensor(state[shard][key])
                target.copy_(rows_of_this_rank(shard, tensors[key]).reshape(target.shape))
            state[shard]["step"] = torch.tensor(float(step))
    if optimizer.grad_scaler is not None and "grad_scaler" in loaded:
        optimizer.grad_scaler.load_state_dict(loaded["grad_scaler"])
