"""Fault handling: preemption signals and non-finite steps, agreed on by all ranks."""

from __future__ import annotations

import signal
from typing import Any

import torch

from dfm.platform.distributed import alone
from dfm.platform.exit_deadline import ExitDeadline
from dfm.platform.parent_watch import STOP_SIGNALS


class PreemptionSignal:
    """Records SIGTERM / SIGUSR1 (Slurm preemption); ranks agree through ``step_checks`` each step.

    ``exit_timeout_s`` (> 0): a process still running that long after the first signal (a save or a
    collective that never returns) writes its stacks and exits 3 (dfm/platform/exit_deadline.py)."""

    SIGNALS = STOP_SIGNALS

    def __init__(self, enabled: bool, exit_timeout_s: float = 0.0):
        self.received: int | None = None
        self.previous: dict[int, Any] = {}
        self.deadline: ExitDeadline | None = None
        if enabled:
            for sig in self.SIGNALS:
                self.previous[sig] = signal.signal(sig, self._handle)
            if exit_timeout_s > 0:
                self.deadline = ExitDeadline(exit_timeout_s, self.SIGNALS).arm()

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def local_flag(self, device: torch.device) -> torch.Tensor:
        """1.0 if this rank got a signal, else 0.0 (shape [])."""
        return torch.tensor(1.0 if self.received is not None else 0.0, device=device)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        if self.deadline is not None:
            self.deadline.disarm()


def step_checks(
    model: list[Any], losses: list[torch.Tensor], preemption: PreemptionSignal, device: torch.device
) -> tuple[bool, bool]:
    """-> (finite, preempt), the same on every rank: every micro-batch loss and gradient of every rank
    is finite; some rank got a preemption signal.

    Both flags travel in one all-reduce (none on a one-process job) and are read in one host sync per
    step; the finite checks stay on the device until then (not one sync per micro-batch and gradient
    buffer).
    """
    flags = torch.stack([local_nonfinite(model, losses, device), preemption.local_flag(device)])
    if not alone():  # alone, the rank's flags are the job's
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
    nonfinite, preempt = flags.tolist()
    return nonfinite == 0.0, preempt > 0.0


def local_nonfinite(model: list[Any], losses: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """1.0 if a loss or gradient of this rank is not finite, else 0.0 (shape [], on the device)."""
    checks = [torch.isfinite(loss).all() for loss in losses]
    for chunk in model:
        checks += [all_finite(grads) for grads in grad_buffers(chunk)]
    if not checks:
        return torch.zeros((), device=device)
    return (~torch.stack(checks)).any().float().to(device)


def all_finite(tensor: torch.Tensor) -> torch.Tensor:
    """No NaN or inf in ``tensor`` (shape [], on its device), from one fp32 sum: NaN or inf anywhere
    makes the sum NaN or inf. A sum that overflows fp32 (elements near 1e34) counts as non-finite too;
    such a step's gradient norm is inf already. No temporaries: ``isfinite`` over a DDP gradient buffer
    (the whole model's gradients) took 7 bytes an element and 30x the time of the sum on the CPU."""
    return torch.isfinite(tensor.sum(dtype=torch.float32))


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
