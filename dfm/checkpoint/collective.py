"""The few collectives the save / load steps need; without a process group they act on one process."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def rank() -> int:
    return torch.distributed.get_rank() if distributed() else 0


def world_size() -> int:
    return torch.distributed.get_world_size() if distributed() else 1


def barrier() -> None:
    if distributed():
        torch.distributed.barrier()


def decided_on_rank0(decide: Callable[[], T]) -> T:
    """``decide()`` runs on rank 0 only; every rank gets its result (file-system decisions agree)."""
    box: list[Any] = [decide() if rank() == 0 else None]
    if distributed():
        torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def gathered(value: T) -> list[T]:
    """Every rank's ``value``, in rank order, on every rank."""
    if not distributed():
        return [value]
    out: list[Any] = [None] * world_size()
    torch.distributed.all_gather_object(out, value)
    return out


def maxima(values: list[float]) -> list[float]:
    """Each of ``values``' maximum over the ranks, on every rank (one all-reduce)."""
    if not distributed():
        return list(values)
    flags = torch.tensor(values, dtype=torch.float32, device=collective_device())
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
    return flags.tolist()


def collective_device() -> torch.device:
    """Where the default group takes its tensors: the rank's GPU under NCCL, else the host."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
