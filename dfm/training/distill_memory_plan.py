"""The memory plan of a DMD2 distillation (``distill.enabled``; docs/distillation.md): every rank holds three
networks of the run's model config (dfm/training/distill_loop.py).

* student and critic: each a trained model laid out as the ``ddp`` section says: ``rank_plan``'s state
  (weights, gradients, optimizer state) twice.
* teacher: weights only, at the parameters' dtype (bf16 under bf16 precision): it is frozen, without DDP,
  gradients or optimizer, so only its TP slice divides it, never data parallelism.
* activations, of the larger step: the student's keeps its forward's saved activations while the teacher
  (twice with guidance) and the critic run without grad, one block's activations at a time (at most what a
  block saves for backward), then its backward's working set; the critic's makes the student sample
  without grad before its own forward, so it never holds more than one model's training step.
* save / load: all three models' state, plus both players' own checkpoint shards (one save writes both; the
  critic is the student's companion) and one buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dfm.checkpoint.files import format_bytes
from dfm.training.memory import RankBytes, local_parameter_count
from dfm.training.memory_plan import (
    BUILD_CHUNK,
    IO_BUFFER,
    Activations,
    PhasePlan,
    config_plan,
    ddp_layout,
    describe,
    device_memory,
    ema_bytes,
    layer_activation_bytes,
    own_checkpoint_shard,
    parameter_bytes,
    report_plan,
    tokens_per_rank,
)

PLAYERS = 2  # the student and the critic: the same network, layout and optimizer


@dataclass(frozen=True)
class DistillPlan:
    """Bytes per rank: one player's own plan, the teacher's weights, and the rank with all three."""

    player: PhasePlan  # the student as a model of its own; the critic's is the same
    teacher: int
    combined: PhasePlan


def distill_plan(cfg, layout, share: int, samples_per_pack: int = 1) -> DistillPlan:
    """The plan of a rank holding ``share`` parameters of each network (its TP slice; pipeline parallelism
    is refused for distillation)."""
    player = config_plan(cfg, layout, share, samples_per_pack)
    per = parameter_bytes(cfg)
    teacher = share * per.params
    state = player.state + player.state + RankBytes(teacher, 0, 0)
    shards = own_checkpoint_shard(share, per, layout.dp * layout.cp) * PLAYERS
    checkpoint_io = state.total + shards + IO_BUFFER
    tokens, text_tokens = tokens_per_rank(cfg, layout, samples_per_pack)
    no_grad_call = max(layer_activation_bytes(cfg.model, tokens, text_tokens))
    activations = student_step_activations(player.activations, no_grad_call)
    # The student's EMA (optimizer.ema_decay) once: the critic keeps none.
    ema, ema_shard = ema_bytes(cfg, share, ddp_layout(cfg), layout.dp * layout.cp)
    checkpoint_io += ema + ema_shard
    combined = PhasePlan(
        state.params + BUILD_CHUNK, state, activations, player.fsdp_units, checkpoint_io, checkpoint_io, ema
    )
    return DistillPlan(player, teacher, combined)


def student_step_activations(player: Activations, no_grad_call: float) -> Activations:
    """The student step's: its saved activations, held through the no-grad teacher and critic calls and
    then its backward (the larger of the two working sets). The critic step's are ``player`` alone."""
    return Activations(saved=player.saved, working=max(player.working, no_grad_call))


def describe_distill(plan: DistillPlan, precision: str, device_bytes: int | None) -> list[str]:
    """Readable lines: the three networks, then ``describe``'s phases of the rank holding them."""
    return [
        f"DMD2: student and critic each {plan.player.state.describe()}; teacher weights "
        f"{format_bytes(plan.teacher)} (frozen, {precision}); activations of the student step (the larger)",
        *describe(plan.combined, device_bytes),
    ]


def log_distill_plan(cfg, layout, student, device: torch.device) -> None:
    """Start-up log (rank 0): the plan of a rank holding its share of the three networks (``describe_distill``,
    the student's share standing for each), with ``log_plan``'s warning when the device's memory is known and
    the plan does not fit it."""
    if torch.distributed.get_rank() != 0:
        return
    plan, total = distill_plan(cfg, layout, local_parameter_count(student)), device_memory(device)
    lines = describe_distill(plan, cfg.mixed_precision.precision, total)
    report_plan("memory plan per rank (a DMD2 distillation)", lines, plan.combined, total)
