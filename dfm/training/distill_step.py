"""The megatron ``forward_step_func``s of a DMD2 distillation (docs/distillation.md): the critic's flow-matching
loss on detached student samples, and the student's distribution-matching loss with backward simulation (plus,
with ``distill.regression_weight`` > 0, DMD's regression onto the teacher's ODE sample from the same noise; with
the GAN weights > 0, DMD2's classifier loss in the critic's step and the generator loss in the student's).

Each network is called as the flow pipeline calls a model, ``net(x_in [S, D], c_noise [N], batch=pack)``: the
DDP-wrapped student and critic, the unwrapped frozen teacher. One pipeline stage (the distill config refuses
more), so the "output" a forward step hands the schedule is already the per-sample loss [N].
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from megatron.core import parallel_state

from dfm.checkpoint.fsdp_state import is_fsdp
from dfm.data.packed_batch import PackedBatch
from dfm.diffusion.flow import FlowPipeline
from dfm.diffusion.pipeline import SamplingOptions, null_dropped_context
from dfm.distill import (
    Conditioning,
    DistillSettings,
    Packing,
    ScoreNets,
    classifier_logits,
    collapse_statistics,
    critic_loss,
    distribution_matching_loss,
    gan_critic_loss,
    gan_student_loss,
    generate_student_sample,
    regression_loss,
)
from dfm.distill.collapse import same_shape_samples
from dfm.distill.student_sampling import StudentSample, choose_step, fresh_noise

CRITIC, STUDENT = "critic", "student"
COLLAPSE_KEYS = ("collapse_mean", "collapse_std", "collapse_distance", "collapse_diversity")


@dataclass
class Players:
    """The three networks: ``student`` and ``critic`` DDP-wrapped chunks, ``teacher`` the frozen module."""

    student: Any
    critic: Any
    teacher: Any


def pack_generator(seed: int, iteration: int, role: str, batch: PackedBatch) -> torch.Generator:
    """The CPU generator of a pack's draws in one player's step: a function of (seed, iteration, role, the
    pack's first global sample index) only, so a resumed run draws what an uninterrupted one does."""
    first = int(batch.host_view().sample_index[0])
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}:{iteration}:{role}:{first}".encode()))


def conditioning(batch: PackedBatch, guidance_scale: float) -> Conditioning:
    """The pack's text for every network; with guidance, also the pack with every sample's text dropped
    (as training's classifier-free dropout drops it) for the teacher's unconditional prediction."""
    if guidance_scale == 1.0:
        return Conditioning({"batch": batch})
    dropped = torch.ones(batch.num_samples, dtype=torch.bool, device=batch.context.device)
    pooled = None if batch.pooled_text is None else torch.zeros_like(batch.pooled_text)
    context = null_dropped_context(batch.context, batch.cu_seqlens_kv_padded, dropped)
    return Conditioning({"batch": batch}, {"batch": dataclasses.replace(batch, context=context, pooled_text=pooled)})


def mean_and_count(per_sample: torch.Tensor) -> torch.Tensor:
    """[2] fp32: a pack's mean of a logged loss term and 1 (the count ``DistillPlayers.mean_over_packs`` divides by)."""
    mean = per_sample.detach().float().mean()
    return torch.stack([mean, torch.ones_like(mean)])


def collapse_figures(x0: torch.Tensor, batch: PackedBatch, packing: Packing) -> torch.Tensor:
    """[4] fp32 ``COLLAPSE_KEYS`` of the student's samples ``x0 [S, D]``: the mean over samples of their means
    and stds, and over the pack's most common latent shape the mean pairwise distance and the diversity
    against the pack's data latents; NaN where no two samples share a shape."""
    shapes = [tuple(shape) for shape in batch.host_view().latent_shape.tolist()]
    subset = same_shape_samples(packing, shapes)
    if subset is None:
        return torch.tensor([float("nan")] * len(COLLAPSE_KEYS))
    tokens, sub_packing = subset
    stats = collapse_statistics(x0[tokens], sub_packing, batch.latents[tokens])
    return torch.tensor([stats.mean.mean().item(), stats.std.mean().item(), stats.pairwise_distance, stats.diversity])


class DistillForwardStep:
    """Callable as megatron's forward_step_func(data_iterator, model) for one player (``role``); ``iteration``
    is set by the loop. ``pipeline`` and ``expert_boundary`` are what the training loop reads of a forward step."""

    expert_boundary = None  # a distillation trains one model

    def __init__(
        self,
        role: str,
        pipeline: FlowPipeline,
        settings: DistillSettings,
        players: Players,
        seed: int,
        device: torch.device,
        regression_teacher_steps: int = 12,
    ):
        self.role, self.pipeline, self.settings, self.players = role, pipeline, settings, players
        self.seed, self.device = seed, device
        self.regression_teacher_steps = regression_teacher_steps
        self.iteration = 0
        # Megatron-FSDP gathers the student's weights in every call, and expert parallelism sends its tokens to
        # the experts' ranks: either way the data-parallel ranks must call the student equally often.
        collective_calls = is_fsdp(players.student) or parallel_state.get_expert_model_parallel_world_size() > 1
        self.common_index = self.largest_over_data_parallel if collective_calls else None

    def __call__(self, data_iterator, model):
        batch = next(data_iterator).to(self.device)
        packing = Packing(batch.token_sample_ids(), batch.loss_mask, batch.num_samples)
        generator = pack_generator(self.seed, self.iteration, self.role, batch)
        cond = conditioning(batch, self.settings.guidance_scale)
        noise = fresh_noise(batch.latents, generator)  # the student's starting noise, padding included
        if self.role == STUDENT:
            return self.student_loss(model, batch, packing, noise, generator, cond)
        return self.critic_loss(model, batch, packing, noise, generator, cond)

    def student_loss(self, student, batch, packing, noise, generator, cond):
        """DMD's loss of a backward-simulated student sample, in the reference code's mean-squared scale; with
        ``regression_weight`` > 0 plus that weight times ``regression`` where it applies (logged as
        ``regression``: the pack's mean and 1, or zeros where it does not apply)."""
        sample = self.student_sample(student, noise, packing, generator, cond)
        scores = ScoreNets(self.players.teacher, self.players.critic)
        matching = distribution_matching_loss(self.pipeline, scores, sample.x0, packing, self.settings, cond, generator)
        per_sample = matching.loss / matching.elements
        extra = {}
        if self.settings.gan_student_weight > 0:
            gan = gan_student_loss(
                self.pipeline, self.players.critic, sample.x0, packing, self.settings, cond, generator
            )
            per_sample = per_sample + self.settings.gan_student_weight * gan
            extra["gan"] = mean_and_count(gan)
        if self.settings.regression_weight > 0:
            regression = self.regression(sample, noise, packing, cond)
            extra["regression"] = torch.zeros(2, device=per_sample.device)
            if regression is not None:
                per_sample = per_sample + self.settings.regression_weight * regression
                extra["regression"] = mean_and_count(regression)
        return per_sample, partial(self.reduce, batch, extra)

    def regression(self, sample: StudentSample, noise, packing, cond) -> torch.Tensor | None:
        """[N] DMD's paired regression: the mean squared distance of the student's clean prediction from the
        pack's starting noise (its first step, t = 1) to the teacher's guided Euler ODE sample from that noise.
        None where the backward simulation chose a later step (a k-step student: 1 pack in k on average), whose
        sample is not a function of that noise alone (the re-noising draws fresh noise)."""
        if sample.step_index != 0:
            return None
        return regression_loss(sample.x0, self.teacher_sample(noise, packing, cond), packing)

    def teacher_sample(self, noise, packing, cond) -> torch.Tensor:
        """[S, *] the frozen teacher's ODE sample from ``noise`` (no grad): the pipeline's sampler, Euler over
        ``regression_teacher_steps`` of the flow schedule, guided by ``guidance_scale`` as the DMD loss's teacher."""
        options = SamplingOptions(
            steps=self.regression_teacher_steps, guidance_scale=self.settings.guidance_scale, sampler="euler"
        )
        return self.pipeline.sample(self.players.teacher, noise, packing.sample_ids, options, cond.cond, cond.uncond)

    def teacher_figures(self, batch: PackedBatch) -> torch.Tensor:
        """[4] ``COLLAPSE_KEYS`` of the teacher's guided ODE samples (``teacher_sample``) of ``batch`` from noise of
        its own generator (seed, the pack's first sample index): the reference the student's diversity is
        compared with (``DistillPlayers.teacher_diversity``)."""
        batch = batch.to(self.device)
        packing = Packing(batch.token_sample_ids(), batch.loss_mask, batch.num_samples)
        noise = fresh_noise(batch.latents, pack_generator(self.seed, 0, "teacher", batch))
        with torch.no_grad():
            x0 = self.teacher_sample(noise, packing, conditioning(batch, self.settings.guidance_scale))
        return collapse_figures(x0, batch, packing)

    def critic_loss(self, critic, batch, packing, noise, generator, cond):
        """The critic's flow-matching loss on a student sample made without grad (plus, with the GAN loss on, the
        classifier's loss on that sample against the pack's data latents), and that sample's collapse figures."""
        with torch.no_grad():
            sample = self.student_sample(self.players.student, noise, packing, generator, cond)
        per_sample = critic_loss(self.pipeline, critic, sample.x0, packing, self.settings, cond, generator)
        extra = {"collapse": collapse_figures(sample.x0.detach(), batch, packing)}
        if self.settings.gan:
            fake, real = (
                classifier_logits(self.pipeline, critic, x0.detach(), packing, self.settings, cond, generator)
                for x0 in (sample.x0, batch.latents)
            )
            gan = gan_critic_loss(fake, real)
            per_sample = per_sample + self.settings.gan_critic_weight * gan
            extra["gan"] = mean_and_count(gan)
        return per_sample, partial(self.reduce, batch, extra)

    def student_sample(self, student, noise, packing, generator, cond) -> StudentSample:
        """The backward-simulated student sample of the pack; under Megatron-FSDP or expert parallelism after as
        many dropped no-grad student calls as keep this rank calling the student as often as its data-parallel
        peers."""
        if self.common_index is not None:
            self.call_in_step(student, noise, packing, generator, cond)
        return generate_student_sample(self.pipeline, student, noise, packing, self.settings, generator, cond)

    def call_in_step(self, student, noise, packing, generator, cond) -> None:
        """No-grad student calls, outputs dropped, up to the largest step index its peers drew. The index is
        ``generate_student_sample``'s first draw: read here from a copy of the generator, leaving it as it was."""
        timesteps = self.settings.student_timesteps
        drawn = choose_step(len(timesteps), torch.Generator(generator.device).set_state(generator.get_state()))
        with torch.no_grad():
            for _ in range(self.common_index(drawn) - drawn):
                self.pipeline.denoise(student, noise, timesteps[0], packing.sample_ids, **cond.cond)

    def largest_over_data_parallel(self, index: int) -> int:
        """The largest backward-simulation step index drawn by this rank's data-parallel (and context-parallel)
        peers for their packs: a collective over that group."""
        largest = torch.tensor([index], dtype=torch.long, device=self.device)
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX, group=group)
        return int(largest.item())

    @staticmethod
    def reduce(batch: PackedBatch, extra: dict, per_sample: torch.Tensor):
        """The schedule's loss closure: the pack's mean loss and the logged numbers (as DiffusionForwardStep's)."""
        loss = per_sample.mean()
        stats = torch.stack([loss.detach().float(), batch.loss_mask.detach().sum().float()])
        return loss, {"loss_and_tokens": stats, **extra}
