"""A DMD2 distillation run (``distill.enabled``; docs/distillation.md): its three models, and what one
iteration of the training loop trains and logs.

The student and the critic are built like any dfm model (DDP chunks, a megatron optimizer and LR schedule
each) and both start from the teacher's weights (``checkpoint.pretrained``); the teacher is a frozen module
without DDP, gradients or optimizer state. Every iteration the critic takes a step; every ``critic_steps``-th
the student first takes one. The critic is saved as a companion of the student in the same checkpoint.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from dfm.checkpoint.errors import CheckpointError
from dfm.checkpoint.pretrained_model import saved_model_section
from dfm.checkpoint.select import choose_checkpoint
from dfm.checkpoint.state import Companion, TrainingState
from dfm.checkpoint.weights_only import load_weights
from dfm.config.container import ConfigContainer
from dfm.diffusion.registry import pipeline_from_config
from dfm.models.build import build_model_chunk
from dfm.parallel.layout import ParallelLayout
from dfm.training.distill_step import COLLAPSE_KEYS, CRITIC, STUDENT, DistillForwardStep, Players
from dfm.training.ema import build_ema
from dfm.training.losses import is_loss_reporting_rank, reduce_loss_and_tokens
from dfm.training.metrics_log import finite_or_none, fmt
from dfm.training.setup import build_model, build_optimizer
from dfm.training.validation import level_record, losses_per_level

logger = logging.getLogger("dfm.train")


@dataclass
class PlayerStep:
    """One player's optimizer step (``train_step``'s result)."""

    losses: list  # the schedule's per-micro-batch dicts
    updated: bool
    grad_norm: float | None
    preempt: bool


@dataclass
class DistillOutcome:
    """An iteration's steps: the critic's, and the student's when it took one."""

    critic: PlayerStep
    student: PlayerStep | None


def frozen_teacher(cfg: ConfigContainer, layout: ParallelLayout, device: torch.device):
    """The ``checkpoint.pretrained`` model as one module on ``device``: eval mode, no gradients. A teacher
    saved with another diffusion pipeline is refused (its outputs would be read as velocities)."""
    path = cfg.checkpoint.pretrained
    saved = saved_model_section(path) or {}
    if saved.get("pipeline", "flow") != "flow":
        raise CheckpointError(
            f"checkpoint.pretrained={path} was trained with model.pipeline={saved['pipeline']}: "
            "distill.enabled=true distils a flow-matching teacher"
        )
    teacher, _ = build_model_chunk(
        cfg.model, cfg.mixed_precision.precision, cfg.rng.seed, None, layout, device, params_dtype_everywhere=True
    )
    load_weights(choose_checkpoint(path), [teacher], cfg.model, path)
    return teacher.requires_grad_(False).eval()


def build_distillation(
    cfg: ConfigContainer, layout: ParallelLayout, device: torch.device, loader
) -> tuple[TrainingState, DistillPlayers]:
    """The run's state (the student, with the critic as its companion; initial weights are the caller's to
    load) and the loop's hook (``DistillPlayers``) over them and the teacher."""
    student, tconfig = build_model(cfg, layout, device)
    optimizer, scheduler = build_optimizer(cfg, student, tconfig)
    # Its own TransformerConfig: its own grad hooks. With the GAN loss on, it carries the classifier.
    critic, critic_tconfig = build_model(cfg, layout, device, classifier=cfg.distill.settings().gan)
    critic_optimizer, critic_scheduler = build_optimizer(cfg, critic, critic_tconfig)
    companion = Companion(critic, critic_optimizer, critic_scheduler)
    ema = build_ema(student, cfg.optimizer.ema_decay)  # the student's (optimizer.ema_decay), updated at its steps
    state = TrainingState(student, optimizer, scheduler, loader, ema, companions={CRITIC: companion})
    players = Players(student[0], critic[0], frozen_teacher(cfg, layout, device))
    pipeline, settings = pipeline_from_config(cfg), cfg.distill.settings()
    steps = {
        role: DistillForwardStep(
            role, pipeline, settings, players, cfg.rng.seed, device, cfg.distill.regression_teacher_steps
        )
        for role in (STUDENT, CRITIC)
    }
    return state, DistillPlayers(settings, steps, cfg.distill.collapse_warning)


class DistillPlayers:
    """The training loop's hook for a distillation: ``step`` trains the players of one iteration on the same
    packs, ``record`` and ``console_line`` make its metrics line."""

    def __init__(self, settings, steps: dict[str, DistillForwardStep], collapse_warning: float = 0.0):
        self.settings, self.steps = settings, steps
        self.last_student: tuple[int, PlayerStep] | None = None  # the latest student step, logged until the next
        self.collapse_warning = collapse_warning  # distill.collapse_warning: 0, off
        self.teacher_diversity: float | None = None  # measured at the run's first iteration
        self.warned = False  # the student is below the warning's bar (warned once until it recovers)

    @property
    def forward_step(self) -> DistillForwardStep:
        return self.steps[STUDENT]

    def step(self, loop, iteration: int) -> tuple[DistillOutcome, bool]:
        """-> (the iteration's steps, preempt). ``updates_student`` counts from 0, the loop from 1."""
        packs = [next(loop.state.loader) for _ in range(loop.n_micro)]
        if self.collapse_warning > 0 and self.teacher_diversity is None:
            self.teacher_diversity = self.measure_teacher_diversity(packs, loop.device)
        student = None
        if self.settings.updates_student(iteration - 1):
            student = self.train(loop, STUDENT, loop.state, packs, iteration)
            self.last_student = (iteration, student)
            if student.updated and loop.state.ema is not None:
                loop.update_ema()
        critic = self.train(loop, CRITIC, loop.state.companions[CRITIC], packs, iteration)
        loop.guard.record(critic.updated and (student is None or student.updated), iteration)
        return DistillOutcome(critic, student), critic.preempt or (student is not None and student.preempt)

    def train(self, loop, role: str, player, packs: list, iteration: int) -> PlayerStep:
        """One optimizer step of ``player`` (model, optimizer, scheduler) over ``packs``. Both players' LR
        schedules count iterations: the student, updated every ``critic_steps``-th one, advances its schedule
        by ``critic_steps`` an update (warm-up and decay then end where the critic's do)."""
        state = TrainingState(player.model, player.optimizer, player.scheduler, iter(packs))
        step = PlayerStep(*loop.train_model(self.steps[role], state, iteration))
        if role == STUDENT and step.updated and self.settings.critic_steps > 1:
            player.scheduler.step(increment=self.settings.critic_steps - 1)
        return step

    def record(self, loop, iteration: int, outcome: DistillOutcome, window) -> dict[str, Any]:
        """One metrics.jsonl line: both players' losses, gradient norms and lrs (the student's from its latest
        step), the collapse figures of the critic step's student samples, and the loop's timing fields."""
        critic_loss, _ = reduce_loss_and_tokens(outcome.critic.losses, loop.device)
        student_iteration, student = self.last_student or (None, None)
        student_loss = reduce_loss_and_tokens(student.losses, loop.device)[0] if student is not None else None
        regression = student_gan = critic_gan = None
        if student is not None and self.settings.regression_weight > 0:
            regression = self.mean_over_packs(student.losses, "regression", loop.device)
        if student is not None and self.settings.gan_student_weight > 0:
            student_gan = self.mean_over_packs(student.losses, "gan", loop.device)
        if self.settings.gan:
            critic_gan = self.mean_over_packs(outcome.critic.losses, "gan", loop.device)
        collapse = torch.stack([item["collapse"] for item in outcome.critic.losses]).nanmean(0).tolist()
        if loop.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - window.start
        # Throughput fields from the pretraining line; its FLOPs count one model call per pack, not this run's.
        base = loop.record(iteration, critic_loss, None, elapsed, window)
        dropped = ("loss", "grad_norm", "lr", "tflops_per_gpu", "mfu")
        return {key: value for key, value in base.items() if key not in dropped} | {
            "critic_loss": critic_loss,
            "student_loss": student_loss,
            "student_iteration": student_iteration,
            "student_regression_loss": regression,
            "student_gan_loss": student_gan,
            "critic_gan_loss": critic_gan,
            "critic_grad_norm": finite_or_none(outcome.critic.grad_norm),
            "student_grad_norm": finite_or_none(student.grad_norm) if student is not None else None,
            "critic_lr": loop.state.companions[CRITIC].optimizer.param_groups[0]["lr"],
            "student_lr": loop.state.optimizer.param_groups[0]["lr"],
            **{key: value if math.isfinite(value) else None for key, value in zip(COLLAPSE_KEYS, collapse)},
            "teacher_diversity": self.teacher_diversity,
        }

    def measure_teacher_diversity(self, packs: list, device: torch.device) -> float | None:
        """The teacher's ``collapse_diversity`` on ``packs``: the mean over packs (with two samples of a shape)
        and DP ranks; None where no pack has. A collective: every rank calls it."""
        figures = [self.steps[CRITIC].teacher_figures(pack)[3] for pack in packs]
        stats = [{"d": torch.stack([d, torch.ones_like(d)]) if d.isfinite() else torch.zeros(2)} for d in figures]
        return self.mean_over_packs(stats, "d", device)

    def warn_if_collapsing(self, record: dict[str, Any]) -> None:
        """A warning when the logged ``collapse_diversity`` is below ``collapse_warning`` times the teacher's
        (once, until it is above again)."""
        diversity, teacher = record.get("collapse_diversity"), self.teacher_diversity
        if not self.collapse_warning or diversity is None or not teacher:
            return
        below = diversity < self.collapse_warning * teacher
        if below and not self.warned:
            logger.warning(
                "iteration %d: the student's sample diversity %.3g is below %g of the teacher's (%.3g): it may be "
                "collapsing onto fewer modes (DMD is mode-seeking; see distill.gan_* and distill.regression_weight, "
                "docs/distillation.md)",
                record["iteration"],
                diversity,
                self.collapse_warning,
                teacher,
            )
        self.warned = below

    @staticmethod
    def validation_losses(loop, packs: list, levels: list[float]) -> dict[str, float]:
        """The critic's validation losses on ``packs`` at ``levels`` (``val_loss_critic``, ``val_loss_critic_t<k>``),
        beside the student's (the loop's ``val_loss``): the critic denoises the student's samples, so its loss
        on data tells how far they are from the data. Collectives: every rank calls it."""
        critic = loop.state.companions[CRITIC].model
        means = losses_per_level(loop.val_forward_step, packs, critic, levels, loop.device)
        record = level_record(levels, means)
        return {f"val_loss_critic{key.removeprefix('val_loss')}": record[key] for key in record if key != "val_levels"}

    @staticmethod
    def mean_over_packs(losses: list[dict], key: str, device: torch.device) -> float | None:
        """A step's logged loss term ``key`` (the regression, a GAN loss; unweighted): the mean over the packs
        it applied to, over micro-batches and DP ranks; None where it applied to none. A collective: every
        rank calls it."""
        stats = torch.zeros(2, device=device)  # sum of the packs' means, packs
        if is_loss_reporting_rank():
            for item in losses:
                stats += item[key].to(device)
        torch.distributed.all_reduce(stats)
        return (stats[0] / stats[1]).item() if stats[1] > 0 else None

    @staticmethod
    def console_line(r: dict[str, Any]) -> str:
        regression = r.get("student_regression_loss")
        return (
            f"iter {r['iteration']:>6}/{r['train_iters']} | critic loss {fmt(r['critic_loss'])} | "
            f"student loss {fmt(r['student_loss'])} (iter {fmt(r['student_iteration'])}) | "
            + ("" if regression is None else f"regression {fmt(regression)} | ")
            + ("" if r.get("critic_gan_loss") is None else f"gan critic {fmt(r['critic_gan_loss'])} ")
            + ("" if r.get("student_gan_loss") is None else f"student {fmt(r['student_gan_loss'])} ")
            + ("" if r.get("critic_gan_loss") is None else "| ")
            + f"grad norm critic {fmt(r['critic_grad_norm'])} student {fmt(r['student_grad_norm'])} | "
            f"lr critic {r['critic_lr']:.3g} student {r['student_lr']:.3g} | skipped {r['skipped_iterations']} | "
            f"{r['step_time_s'] * 1000:.0f} ms/it | {fmt(r['tokens_per_sec_per_gpu'])} tok/s/gpu | collapse "
            + " ".join(f"{key.removeprefix('collapse_')} {fmt(r[key])}" for key in COLLAPSE_KEYS)
            + ("" if r.get("teacher_diversity") is None else f" (teacher's diversity {fmt(r['teacher_diversity'])})")
        )
