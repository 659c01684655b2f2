"""Generation from a DMD2 student: a checkpoint whose saved config has ``distill.enabled=true``.

The student samples over its own ``distill.student_timesteps`` t_0 = 1 > t_1 > ... > t_{k-1}, unguided
(the teacher's guidance is baked in), with one of two samplers:

    dmd2  (default)  x0_i = denoise(x, t_i);  x = interpolate(x0_i, fresh noise, t_{i+1})   (student_trajectory,
                     the sampler it was trained through; the sample is the last x0)
    euler            x = x + (t_{i+1} - t_i) v(x, t_i) over t_0, ..., t_{k-1}, 0             (the flow solver)

With sigma_min = 0, x = (1 - t_i) x0_i + t_i n_i where n_i = x0_i + v is the noise the student predicts, and
an Euler step lands on (1 - t_{i+1}) x0_i + t_{i+1} n_i: euler is dmd2 re-noising with the predicted noise
instead of fresh noise. The last step of both returns x0_{k-1}, so a one-step student gives the same sample.
"""

from __future__ import annotations

import argparse

import torch

from dfm.config.container import ConfigContainer
from dfm.data.packed_batch import PackedBatch
from dfm.diffusion.flow import FlowPipeline
from dfm.diffusion.pipeline import SamplingOptions, at_least_fp32
from dfm.distill.batch import Conditioning, Packing
from dfm.distill.student_sampling import student_trajectory
from dfm.inference.sampling import ProgressNet, denoised_latents, sample_latents

DMD2, EULER = "dmd2", "euler"
STUDENT_SAMPLERS = (DMD2, EULER)


def is_student(cfg: ConfigContainer) -> bool:
    """Whether the checkpoint of ``cfg`` (its saved config) holds a DMD2 student."""
    return cfg.distill.enabled


def student_arguments(cfg: ConfigContainer, args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the student's defaults (its step count, guidance 1, the dmd2 sampler); what a
    student cannot do is refused naming the key. A step count other than the trained one is refused:
    the student was trained at exactly its timesteps, and other times are inputs it never saw."""
    timesteps = cfg.distill.settings().student_timesteps
    if args.num_steps not in (None, len(timesteps)):
        raise ValueError(
            f"--num_steps {args.num_steps}: this checkpoint is a DMD2 student trained to sample in {len(timesteps)} "
            f"steps at distill.student_timesteps={timesteps}; omit --num_steps (or pass {len(timesteps)})"
        )
    guided = args.guidance_scale not in (None, 1.0) or getattr(args, "guidance_scale_2", None) is not None
    if guided or args.negative_prompt is not None:
        raise ValueError(
            "--guidance_scale(_2) / --negative_prompt: a DMD2 student samples unguided, the teacher's guidance "
            f"(distill.guidance_scale={cfg.distill.guidance_scale}) is baked into it"
        )
    sampler = args.sampler or DMD2
    if sampler not in STUDENT_SAMPLERS:
        raise ValueError(f"--sampler {sampler}: a DMD2 student samples with {' or '.join(STUDENT_SAMPLERS)}")
    return argparse.Namespace(**{**vars(args), "num_steps": len(timesteps), "guidance_scale": 1.0, "sampler": sampler})


def renoising_generator(seed: int, start: torch.Tensor) -> torch.Generator:
    """The CPU generator of ``draw_noise(shape, seed)`` past the starting noise ``start``: the re-noising
    draws continue that stream (drawing from a fresh generator of the same seed would reuse its numbers)."""
    generator = torch.Generator().manual_seed(seed)
    torch.randn(start.numel(), generator=generator)  # a draw consumes the stream by its size alone
    return generator


def sample_student_latent(
    model: torch.nn.Module, pipeline: FlowPipeline, batch: PackedBatch, cfg: ConfigContainer, sampler: str, seed: int
) -> torch.Tensor:
    """The clean latent [C, T', H', W'] of a one-sample pack ``batch`` (latents: the starting noise),
    sampled over the student's timesteps with ``sampler`` (``STUDENT_SAMPLERS``)."""
    return sample_student_latents(model, pipeline, batch, cfg, sampler, seed)[0]


def sample_student_latents(
    model: torch.nn.Module, pipeline: FlowPipeline, batch: PackedBatch, cfg: ConfigContainer, sampler: str, seed: int
) -> list[torch.Tensor]:
    """``sample_student_latent`` for every sample of the pack ``batch`` at once -> one clean latent
    [C, T', H', W'] per sample (the re-noising draws cover the whole pack, after its starting noise)."""
    settings = cfg.distill.settings()
    steps = len(settings.student_timesteps)
    if sampler == EULER:
        options = SamplingOptions(steps, 1.0, EULER, seed, timesteps=tuple(settings.student_timesteps))
        return sample_latents(model, pipeline, batch, cfg.model, options)
    generator = renoising_generator(seed, batch.latents)

    def integrate(net: ProgressNet) -> torch.Tensor:
        noise, packing = at_least_fp32(batch.latents), Packing.unpadded(batch.token_sample_ids())
        conditioning = Conditioning(cond={"batch": batch})
        return student_trajectory(pipeline, net, noise, packing, settings, generator, conditioning)[-1]

    return denoised_latents(model, pipeline, batch, cfg.model, integrate, steps, f"{DMD2} student {steps} steps")


def sample_as_trained(
    model: torch.nn.Module,
    pipeline,
    batch: PackedBatch,
    cfg: ConfigContainer,
    options: SamplingOptions,
    noise_seed: int,
) -> torch.Tensor:
    """A one-sample pack's clean latent [C, T', H', W'] sampled as ``cfg``'s model samples: a DMD2 student over
    its own timesteps (``dmd2``, unguided; its re-noising continues the stream of ``draw_noise(shape,
    noise_seed)``, the pack's starting noise), any other model with ``options``."""
    if is_student(cfg):
        return sample_student_latent(model, pipeline, batch, cfg, DMD2, noise_seed)
    return sample_latents(model, pipeline, batch, cfg.model, options)[0]
