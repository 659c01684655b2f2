"""Every parameter as one full tensor under its global name, gathered to rank 0.

What the layout-equivalence tests compare: TP shards are concatenated (the inverse of the
layout-independent init's split, ``dfm.models.common.init``), pipeline stages contribute their
layers and expert-parallel ranks their experts under global names (``dfm.models.common.param_names``).
Tensors travel as pickled objects to rank 0, so this is for small models (tests, debugging);
checkpoints of real runs go through ``dfm.checkpoint``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from dfm.models.common.init import gather_full
from dfm.parallel.fsdp_shards import full_tensor, inner_model, named_parameters


def finish_param_gather(model_chunks) -> None:
    """With the distributed optimizer and overlapped param gather, the updated shards reach the
    other DP ranks only in the next forward; force that all-gather now. (Megatron-FSDP chunks are
    read from their main-weight shards, which the step has updated.)"""
    for chunk in model_chunks:
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is None or ddp_config.use_megatron_fsdp:
            continue
        if ddp_config.use_distributed_optimizer and ddp_config.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)


def local_full_tensors(model_chunks) -> dict[str, Tensor]:
    """This rank's parameters, FSDP and TP shards gathered, under global names (collective over DP, TP)."""
    tensors = {}
    for chunk in model_chunks:
        module = inner_model(chunk)
        for name, param in named_parameters(chunk):
            tensors[module.global_param_name(name)] = gather_full(full_tensor(param)).cpu().clone()
    return tensors


def merge_replicas(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """One tensor per global name; replicas (DP ranks, TP ranks of unsharded params, embedders
    on every pipeline stage) must be bitwise equal, else the layout has diverged."""
    full: dict[str, Tensor] = {}
    for part in parts:
        for name, tensor in part.items():
            if name in full and not torch.equal(full[name], tensor):
                diff = (full[name] - tensor).abs().max().item()
                raise RuntimeError(f"replicas of parameter {name} differ across ranks (max abs diff {diff:g})")
            full.setdefault(name, tensor)
    return dict(sorted(full.items()))


def gather_full_state_dict(model_chunks) -> dict[str, Tensor] | None:
    """Collective over all ranks. Rank 0: {global name: full tensor}; other ranks: None."""
    finish_param_gather(model_chunks)
    local = local_full_tensors(model_chunks)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    parts = [None] * world if rank == 0 else None
    torch.distributed.gather_object(local, parts, dst=0)
    return merge_replicas(parts) if rank == 0 else None


def save_full_weights(model_chunks, path: str | Path) -> None:
    """Rank 0 writes ``gather_full_state_dict`` as one ``torch.save`` file at ``path``."""
    full = gather_full_state_dict(model_chunks)
    if full is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        torch.save(full, path)
