"""Megatron-FSDP's parameter shards: where a rank's rows lie, and (for tests' full-weight dumps)
gathered to full tensors.

Between optimizer steps a Megatron-FSDP model's parameters are DTensors over its fp32 main
weights: each data-parallel rank holds whole rows ``[rows_r, ...]`` of every (TP-local) parameter
``[rows, ...]``, ranks in order, row counts uneven. Mesh dimension 0 is the data-parallel group
(the expert data-parallel group for experts), dimension 1 (if any) tensor parallelism, which
stays as it is: "full" here means TP-local, like a DDP-wrapped model's parameter.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate


def is_fsdp_shard(tensor) -> bool:
    return isinstance(tensor, DTensor)


def _dp_group_and_rows(shard: DTensor) -> tuple[torch.distributed.ProcessGroup | None, list[int]]:
    """The shard's data-parallel group (None when replicated over it) and every rank's row count."""
    if isinstance(shard.placements[0], Replicate):
        return None, [shard.to_local().shape[0] if shard.dim() else 1]
    group = shard.device_mesh.get_group(0)
    local = shard.to_local()
    rows = torch.tensor([local.shape[0]], dtype=torch.long, device=local.device)
    counts = [torch.zeros_like(rows) for _ in range(group.size())]
    torch.distributed.all_gather(counts, rows, group=group)
    return group, [int(c.item()) for c in counts]


def gather_rows(shard: DTensor, local: Tensor | None = None) -> Tensor:
    """``[rows, ...]``: the TP-local parameter from every DP rank's rows (collective over its DP group);
    ``local``: rows sharded like ``shard`` (an optimizer moment, an EMA) to gather instead of its own."""
    local = (shard.to_local() if local is None else local).detach()
    group, counts = _dp_group_and_rows(shard)
    if group is None:
        return local.clone()
    width = max(counts)
    padded = local.new_zeros((width, *local.shape[1:]))
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in counts]
    torch.distributed.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([part[:count] for part, count in zip(parts, counts)])


def tp_local_shape(shard: DTensor) -> torch.Size:
    """The TP-local parameter's shape: the DTensor's global shape with TP's split dimension divided."""
    shape = list(shard.shape)
    for mesh_dim, placement in enumerate(shard.placements[1:], start=1):
        if placement.is_shard():
            shape[placement.dim] //= shard.device_mesh.size(mesh_dim)
    return torch.Size(shape)


def row_range(shard: DTensor) -> tuple[int, int, bool]:
    """(first row, row count) of this DP rank's rows of the TP-local parameter, and whether the shard
    is replicated over DP instead (then every rank holds all rows). Collective over its DP group."""
    group, counts = _dp_group_and_rows(shard)
    if group is None:
        return 0, counts[0], True
    rank = torch.distributed.get_rank(group)
    return sum(counts[:rank]), counts[rank], False


TP_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride")


def full_tensor(param) -> Tensor:
    """A parameter as its TP-local full tensor in the model's dtype, FSDP shards gathered (collective
    over DP), carrying the TP attributes of the model parameter; anything else as it is (not detached:
    a detached copy would lose those attributes)."""
    if not is_fsdp_shard(param):
        return param
    model_param = param.orig_param
    full = gather_rows(param).to(model_param.dtype)
    for name in TP_ATTRIBUTES:
        if hasattr(model_param, name):
            setattr(full, name, getattr(model_param, name))
    return full


def inner_model(chunk):
    """The model inside a wrapped chunk: ``DDP.module``, or ``FullyShardedDataParallel.module.module``
    (Megatron-FSDP nests its own ``MegatronFSDP`` module in between)."""
    module = getattr(chunk, "module", chunk)
    return getattr(module, "module", module) if _is_megatron_fsdp(module) else module


def _is_megatron_fsdp(module) -> bool:
    return type(module).__name__ == "MegatronFSDP"


def named_parameters(chunk) -> list[tuple[str, Tensor]]:
    """The model's parameters by name. Under Megatron-FSDP its main-weight shards (DTensors), whatever
    the module holds at the moment (after a step it may hold the gathered compute weights, whose
    buckets FSDP frees and reuses); under DDP the parameters themselves."""
    model = inner_model(chunk)
    if not _is_megatron_fsdp(getattr(chunk, "module", None)):
        return list(model.named_parameters())
    shards = dict(chunk.module.param_and_grad_buffer.optimizer_named_parameters)
    return [(name, shards[name]) for name, _ in model.named_parameters()]


def install_main_weights(chunks) -> None:
    """After writing into FSDP's main-weight shards (load, EMA swap): copy them into the compute
    weights and gather those, as megatron's optimizer step does; a no-op for DDP chunks."""
    for chunk in chunks:
        if _is_megatron_fsdp(getattr(chunk, "module", None)):
            chunk.module.install_optimized_model_weights()
            chunk.start_param_sync()
