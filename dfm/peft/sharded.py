"""Checkpoint entries of the adapters a TP split shards (B of a column-parallel linear, A of a row one).

megatron's parallel linears build their sharded state dict from their own state dict, treating
every key but ``weight`` / ``bias`` as replicated: the adapter's split matrices would be saved as
one rank's shard. The adapter's linear gets a ``sharded_state_dict`` that places them at their
global offsets (strided ones chunk by chunk, as FLUX's single block needs), so a LoRA checkpoint
loads at any layout like the base weights do.
"""

from __future__ import annotations

from megatron.core import parallel_state
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from torch import nn

from dfm.config.peft import ADAPTER
from dfm.models.flux.strided import strided_factory


def split_adapter_entries(linear: nn.Module, prefix: str, sharded_offsets, metadata) -> dict:
    """{key: sharded tensor} of ``linear``'s adapter matrices that TP splits."""
    params = {
        n: p for n, p in getattr(linear, ADAPTER).named_parameters() if getattr(p, "tensor_model_parallel", False)
    }
    if not params:
        return {}
    metadata = metadata or {}
    dp_cp = metadata.get("dp_cp_group") or parallel_state.get_data_parallel_group(with_context_parallel=True)
    entries = make_sharded_tensors_for_checkpoint(
        params,
        f"{prefix}{ADAPTER}.",
        {name: p.partition_dim for name, p in params.items()},
        sharded_offsets,
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        dp_cp_group=dp_cp,
    )
    for name, param in params.items():
        key, stride = f"{prefix}{ADAPTER}.{name}", getattr(param, "partition_stride", 1)
        if stride > 1:
            entries[key] = strided_factory(entries[key], param.partition_dim, stride)
    return entries


def shard_adapters_in_checkpoints(linear: nn.Module) -> None:
    """``linear.sharded_state_dict`` (megatron's) with its split adapter matrices at their global offsets."""
    original = linear.sharded_state_dict

    def sharded_state_dict(prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        state = original(prefix, sharded_offsets, metadata)
        state.update(split_adapter_entries(linear, prefix, sharded_offsets, metadata))
        return state

    linear.sharded_state_dict = sharded_state_dict
