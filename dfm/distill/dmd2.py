"""DMD2's losses for a flow-matching pipeline: distribution matching (student), fake score (critic),
and the optional regression to teacher samples and GAN loss (a classifier on the critic's features).

Distribution matching (Yin et al. 2024, DMD eq. 7-8; DMD2 keeps it): re-noise the student's clean
sample x0 to x_t, ask the teacher (real score, guided) and the critic (fake score, trained on the
student's samples) for their clean predictions, and push x0 along

    g = (fake - real) / mean |x0 - real|          (mean over the sample's real tokens and features)

i.e. towards the teacher's prediction and away from the critic's. The division is DMD's weighting
factor: it normalises the step per sample, whatever the noise level. The score at (x_t, t) is affine in
the clean prediction, so the paper's weighted score difference is this form up to a factor of t alone;
the released DMD/DMD2 code uses the form above. Clean predictions come from the velocity through the
pipeline's own relation (``FlowPipeline.denoise``).

The re-noising times are t ~ U[min_t, max_t], for the distribution-matching and the critic loss alike,
not the pipeline's training law (logit-normal, shifted): DMD2 draws its levels uniformly, the KL it
descends is integrated over all noise levels (high t corrects layout, low t detail), and the critic
must be trained where it is queried.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from dfm.diffusion.flow import FlowPipeline
from dfm.diffusion.packed_loss import masked_mean_per_sample, per_token
from dfm.diffusion.pipeline import Net, at_least_fp32, guided
from dfm.distill.batch import Conditioning, Packing, on_real_tokens, real_elements
from dfm.distill.settings import DistillSettings
from dfm.distill.student_sampling import fresh_noise, noised


@dataclass(frozen=True)
class ScoreNets:
    """The two networks DMD compares, each ``net(x_in [S, *], c_noise [N], **cond) -> velocity``."""

    teacher: Net  # real score: the frozen pretrained model
    critic: Net  # fake score: trained online on the student's samples (``critic_loss``)


@dataclass
class DistributionMatching:
    """The distribution-matching loss of a pack, and what it is made of."""

    loss: Tensor  # [N] fp32 surrogate 0.5 * sum (x0 - sg(x0 - g))^2: d loss.sum() / d x0 = g
    gradient: Tensor  # [S, *] fp32 the DMD gradient g; 0 on padding
    level: Tensor  # [N] the times x0 was re-noised at
    elements: Tensor  # [N] real tokens x features: loss / elements is the DMD2 reference's mean-squared form


def renoising_levels(settings: DistillSettings, num_samples: int, generator: torch.Generator | None) -> Tensor:
    """[N] fp32 times ~ U[min_t, max_t] (the losses take them to x0's precision if that is higher)."""
    device = generator.device if generator is not None else None
    uniform = torch.rand(num_samples, generator=generator, device=device)
    return settings.min_t + (settings.max_t - settings.min_t) * uniform


def masked_sum_per_sample(values: Tensor, packing: Packing) -> Tensor:
    """Sum of ``values [S, *]`` over each sample's real tokens and features -> [N]."""
    mean = masked_mean_per_sample(values, packing.sample_ids, packing.loss_mask, packing.num_samples)
    return mean * real_elements(packing, values)


def teacher_prediction(
    pipe: FlowPipeline,
    teacher: Net,
    x_t: Tensor,
    level: Tensor,
    packing: Packing,
    conditioning: Conditioning,
    scale: float,
) -> Tensor:
    """The teacher's guided clean prediction [S, *]. Guiding x0_hat equals guiding the velocity: x0_hat is
    affine in v at a fixed (x_t, t) and guidance's weights sum to 1."""
    if conditioning.uncond is None and scale != 1.0:
        raise ValueError(f"distill.guidance_scale={scale} needs the unconditional inputs (Conditioning.uncond)")

    def predict(kwargs: dict) -> Tensor:
        return pipe.denoise(teacher, x_t, level, packing.sample_ids, **kwargs)

    return guided(predict, conditioning.cond, conditioning.uncond, scale)


def dmd_gradient(x0: Tensor, real: Tensor, fake: Tensor, packing: Packing) -> Tensor:
    """g = (fake - real) / mean |x0 - real| per sample, fp32 [S, *], 0 on padding tokens.

    A sample whose normaliser is exactly 0 (x0 equals the teacher's prediction everywhere) gets g = 0.
    """
    x0, real, fake = at_least_fp32(x0), at_least_fp32(real), at_least_fp32(fake)
    normaliser = masked_mean_per_sample((x0 - real).abs(), packing.sample_ids, packing.loss_mask, packing.num_samples)
    safe = torch.where(normaliser > 0, normaliser, torch.ones_like(normaliser))
    gradient = (fake - real) / per_token(safe, packing.sample_ids, x0)
    gradient = torch.where(per_token(normaliser > 0, packing.sample_ids, x0), gradient, torch.zeros_like(gradient))
    return on_real_tokens(gradient, packing)


def dmd_surrogate(x0: Tensor, gradient: Tensor, packing: Packing) -> Tensor:
    """[N] 0.5 * sum over real tokens and features of (x0 - sg(x0 - g))^2, whose gradient w.r.t. x0 is g:
    an ordinary loss to backpropagate that moves x0 by -lr * g under plain gradient descent."""
    x0 = at_least_fp32(x0)
    target = (x0 - gradient).detach()
    # Padding zeroed before squaring: a NaN there then reaches neither the loss nor x0's gradient.
    return 0.5 * masked_sum_per_sample(on_real_tokens(x0 - target, packing) ** 2, packing)


def distribution_matching_loss(
    pipe: FlowPipeline,
    scores: ScoreNets,
    x0: Tensor,
    packing: Packing,
    settings: DistillSettings,
    conditioning: Conditioning | None = None,
    generator: torch.Generator | None = None,
) -> DistributionMatching:
    """DMD's loss of the student's clean samples ``x0 [S, *]`` (with their graph); the teacher and the
    critic run without grad on x0 re-noised at t ~ U[min_t, max_t] (drawn first, then the noise)."""
    conditioning = conditioning or Conditioning()
    level = renoising_levels(settings, packing.num_samples, generator).to(x0.device, at_least_fp32(x0).dtype)
    noise = fresh_noise(x0, generator)
    with torch.no_grad():
        x_t = noised(pipe, x0.detach(), noise, level, packing)
        real = teacher_prediction(pipe, scores.teacher, x_t, level, packing, conditioning, settings.guidance_scale)
        fake = pipe.denoise(scores.critic, x_t, level, packing.sample_ids, **conditioning.cond)
        gradient = dmd_gradient(x0.detach(), real, fake, packing)
    loss = dmd_surrogate(x0, gradient, packing)
    return DistributionMatching(loss, gradient, level, real_elements(packing, x0))


def renoised_input(
    pipe: FlowPipeline, x0: Tensor, packing: Packing, settings: DistillSettings, generator: torch.Generator | None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``x0 [S, *]`` re-noised at t ~ U[min_t, max_t] (drawn first, then the noise) as a model's input ->
    (x_in [S, *], c_noise [N], noise [S, *], level [N])."""
    level = renoising_levels(settings, packing.num_samples, generator).to(x0.device, at_least_fp32(x0).dtype)
    noise = fresh_noise(x0, generator)
    x_in, c_noise = pipe.model_input(x0, noise, level, packing.sample_ids)
    return x_in, c_noise, noise, level


def critic_loss(
    pipe: FlowPipeline,
    critic: Net,
    x0: Tensor,
    packing: Packing,
    settings: DistillSettings,
    conditioning: Conditioning | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """[N] the critic's flow-matching loss on the student's samples ``x0 [S, *]`` (detached: the critic's
    update leaves the student alone), at the re-noising times of ``distribution_matching_loss``."""
    conditioning = conditioning or Conditioning()
    x0 = x0.detach()
    x_in, c_noise, noise, level = renoised_input(pipe, x0, packing, settings, generator)
    raw_out = critic(x_in, c_noise, **conditioning.cond)
    return pipe.training_loss(raw_out, x0, noise, level, packing.sample_ids, packing.loss_mask)


def regression_loss(x0: Tensor, target: Tensor, packing: Packing) -> Tensor:
    """[N] mean squared distance of the student's samples to the teacher's from the same noise (DMD's
    paired regression, here in latent space: no LPIPS on latents). Weighted by ``regression_weight``."""
    squared = (at_least_fp32(x0) - at_least_fp32(target).detach()) ** 2
    return masked_mean_per_sample(squared, packing.sample_ids, packing.loss_mask, packing.num_samples)


def classifier_logits(
    pipe: FlowPipeline,
    critic: Net,
    x0: Tensor,
    packing: Packing,
    settings: DistillSettings,
    conditioning: Conditioning | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """[N] fp32 the critic's GAN logits of ``x0 [S, *]`` re-noised at t ~ U[min_t, max_t] (drawn first, then
    the noise), the levels the critic is trained at; the critic called with ``classify=True``."""
    conditioning = conditioning or Conditioning()
    x_in, c_noise, _, _ = renoised_input(pipe, x0, packing, settings, generator)
    return critic(x_in, c_noise, classify=True, **conditioning.cond)


def gan_critic_loss(fake_logits: Tensor, real_logits: Tensor) -> Tensor:
    """[N] the classifier's logistic loss, softplus(-D(real)) + softplus(D(fake)) (DMD2's discriminator loss),
    from ``classifier_logits`` of the student's samples (detached) and of the pack's data latents."""
    return F.softplus(-real_logits) + F.softplus(fake_logits)


def gan_student_loss(
    pipe: FlowPipeline,
    critic: Net,
    x0: Tensor,
    packing: Packing,
    settings: DistillSettings,
    conditioning: Conditioning | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """[N] softplus(-D(x0)), the non-saturating generator loss of the student's samples ``x0`` (with their
    graph), through the critic, whose weights get no gradient from it."""
    with weights_frozen(critic):
        logits = classifier_logits(pipe, critic, x0, packing, settings, conditioning, generator)
    return F.softplus(-logits)


@contextmanager
def weights_frozen(module: torch.nn.Module) -> Iterator[None]:
    """``module``'s trainable parameters without ``requires_grad`` for the block: the graph built inside
    reaches the inputs only (no weight gradients computed, none accumulated)."""
    trainable = [param for param in module.parameters() if param.requires_grad]
    for param in trainable:
        param.requires_grad_(False)
    try:
        yield
    finally:
        for param in trainable:
            param.requires_grad_(True)
