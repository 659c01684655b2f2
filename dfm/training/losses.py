"""Training and validation losses reduced over micro-batches and data-parallel ranks: the numbers a
run logs, valid on every rank."""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from dfm.diffusion.timestep_experts import EXPERTS


def is_loss_reporting_rank() -> bool:
    return (
        parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        and parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_context_parallel_rank() == 0
    )


def reduce_loss_and_tokens(losses_reduced: list[dict], device: torch.device) -> tuple[float, float]:
    """Mean loss over micro-batches and DP ranks, real tokens summed; valid on every rank."""
    stats = torch.zeros(3, device=device)  # loss sum, micro-batch count, tokens
    if is_loss_reporting_rank():
        for item in losses_reduced:
            loss, tokens = item["loss_and_tokens"]
            stats += torch.stack([loss, torch.ones_like(loss), tokens])
    torch.distributed.all_reduce(stats)
    return (stats[0] / stats[1].clamp(min=1)).item(), stats[2].item()


def reduce_expert_losses(losses_reduced: list[dict], device: torch.device) -> dict[str, float]:
    """Both experts' runs: per expert its samples' mean loss over micro-batches and DP ranks and
    their count (``loss_high_noise``, ``samples_high_noise``, ...); valid on every rank."""
    stats = torch.zeros(2 * len(EXPERTS), device=device)  # per expert: loss sum, samples
    if is_loss_reporting_rank():
        for item in losses_reduced:
            stats += item["expert_losses"]
    torch.distributed.all_reduce(stats)
    record = {}
    for index, expert in enumerate(EXPERTS):
        total, count = stats[2 * index].item(), stats[2 * index + 1].item()
        record |= {f"loss_{expert}": total / count if count else None, f"samples_{expert}": int(count)}
    return record
