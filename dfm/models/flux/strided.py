"""Tensor-parallel shards that are strided: rank r holds chunks r, r + tp, r + 2 tp, ... of a tensor.

FLUX's single block feeds ``cat(attention out [h], MLP hidden [k h])`` into one row-parallel
projection. With the MLP's columns sharded with stride k and the projection's input with stride
k + 1, every chunk has h / tp columns and rank r's input slice [its heads, its MLP columns] meets
exactly its projection columns. ``dfm.models.common.init`` draws and gathers such shards from the
stride; checkpoints need each chunk saved at its own global offset, which megatron's plain
sharded state dict (one contiguous slice per rank) does not do: ``strided_sharded_state_dict`` does.
"""

from __future__ import annotations

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
from torch import nn


def mark_strided(param: nn.Parameter, dim: int, stride: int) -> None:
    """Declare ``param`` a TP shard along ``dim`` made of ``stride`` chunks."""
    set_tensor_model_parallel_attributes(param, True, dim, stride)


def strided_factory(sharded: ShardedTensor, dim: int, stride: int) -> ShardedTensorFactory:
    """``sharded`` (one contiguous slice per TP rank along ``dim``) -> its ``stride`` chunks at their
    global fragments ``step * tp + rank`` of ``stride * tp``; loading concatenates them back."""
    if sharded.prepend_axis_num:
        raise ValueError(f"{sharded.key}: strided shards under prepended axes are not supported")
    tp = sharded.axis_fragmentations[dim]
    rank = sharded.global_offset[dim] // sharded.local_shape[dim]

    @torch.no_grad()
    def build(key, tensor, replica_id, flattened_range):
        return [
            ShardedTensor.from_rank_offsets(key, chunk, (dim, step * tp + rank, stride * tp), replica_id=replica_id)
            for step, chunk in enumerate(torch.chunk(tensor, stride, dim=dim))
        ]

    def merge(chunks):
        return torch.cat(chunks, dim=dim)

    return ShardedTensorFactory(sharded.key, sharded.data, build, merge, sharded.replica_id)


def strided_sharded_state_dict(module: nn.Module, state: dict, prefix: str) -> dict:
    """``state`` (``module.sharded_state_dict(prefix)``) with every strided parameter made a factory."""
    for name, param in module.named_parameters():
        stride = getattr(param, "partition_stride", 1)
        if getattr(param, "tensor_model_parallel", False) and stride > 1:
            state[prefix + name] = strided_factory(state[prefix + name], param.partition_dim, stride)
    return state
