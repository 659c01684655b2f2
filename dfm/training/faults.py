"""Fault handling: preemption signals and non-finite steps, agreed on by all ranks."""

from __future__ import annotations

import signal
from typing import Any

import torch


class PreemptionSignal:
    """Records SIGTERM / SIGUSR1 (Slurm preemption); ranks agree via ``requested()`` each step."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, enabled: bool):
        self.received: int | None = None
        self.previous: dict[int, Any] = {}
        if enabled:
            for sig in self.SIGNALS:
                self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def requested(self, device: torch.device) -> bool:
        """True on every rank if any rank got a signal (one tiny all-reduce)."""
        flag = torch.tensor([1.0 if self.received is not None else 0.0], device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def grads_are_finite(model: list[Any], losses: list[torch.Tensor], device: torch.device) -> bool:
    """True on every rank iff every micro-batch loss and every gradient of every rank is finite.

    The checks stay on the device until one all-reduced flag is read: one sync per step, not
    one per micro-batch and gradient buffer.
    """
    checks = [torch.isfinite(loss).all() for loss in losses]
    for chunk in model:
        checks += [torch.isfinite(grads).all() for grads in grad_buffers(chunk)]
    flag = (~torch.stack(checks)).any().float().reshape(1) if checks else torch.zeros(1, device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return flag.item() == 0.0


def grad_buffers(chunk) -> list[torch.Tensor]:
    """The gradients of a DDP chunk (its flat buffers) or of a Megatron-FSDP chunk: this rank's rows
    of each parameter's gradient, not FSDP's flat buffers, whose padding is never written."""
    if chunk.ddp_config.use_megatron_fsdp:
        shards = chunk.param_and_grad_buffer.optimizer_named_parameters
        return [shard.grad.to_local() for _, shard in shards if shard.grad is not None]
    return [buffer.grad_data for buffer in chunk.buffers + chunk.expert_parallel_buffers]


class NonFiniteGuard:
    """Counts skipped steps; stops the run after ``limit`` non-finite steps in a row."""

    def __init__(self, limit: int):
        self.limit = limit
        self.skipped = 0
        self.in_a_row = 0

    def record(self, finite: bool, iteration: int) -> None:
        if finite:
            self.in_a_row = 0
            return
        self.skipped += 1
        self.in_a_row += 1
        if self.in_a_row >= self.limit:
            raise RuntimeError(
                f"stopping at iteration {iteration}: {self.in_a_row} consecutive iterations with a non-finite "
                f"loss or gradient (train.max_consecutive_nonfinite={self.limit})"
            )
