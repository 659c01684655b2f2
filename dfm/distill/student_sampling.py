"""The student's k-step generation, and DMD2's backward simulation of it for a training step.

Each student step takes x at time t_i to a clean prediction x0_i (the flow pipeline's ``denoise``),
then re-noises x0_i with fresh noise to the next time (the pipeline's ``interpolate``): the
consistency-model style multistep sampler DMD2 uses. Training on the student's own intermediate
inputs (not on noised real data) is what DMD2 calls backward simulation: it removes the mismatch
between the inputs the student is trained on and those it meets when it generates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dfm.diffusion.flow import FlowPipeline
from dfm.diffusion.pipeline import Net, at_least_fp32, initial_noise
from dfm.distill.batch import Conditioning, Packing
from dfm.distill.settings import DistillSettings


@dataclass
class StudentSample:
    """A student sample for one training step."""

    x0: Tensor  # [S, *] clean sample; its graph runs through the chosen step's network call only
    step_index: int  # which of ``student_timesteps`` produced it
    level: float  # that step's t


def noised(pipe: FlowPipeline, x0: Tensor, noise: Tensor, level: Tensor, packing: Packing) -> Tensor:
    """x_t [S, *] in x0's dtype for per-sample times ``level [N]`` (the pipeline's path)."""
    return pipe.interpolate(x0, noise, level, packing.sample_ids).to(x0.dtype)


def fresh_noise(like: Tensor, generator: torch.Generator | None) -> Tensor:
    """Standard normal [S, *] of ``like``'s shape, in at least fp32, on its device."""
    return initial_noise(like.shape, generator, at_least_fp32(like).dtype).to(like.device)


def per_sample_time(level: float, packing: Packing, like: Tensor) -> Tensor:
    """One time for every sample: [N] in at least fp32."""
    return torch.full((packing.num_samples,), level, dtype=at_least_fp32(like).dtype, device=like.device)


def renoise(
    pipe: FlowPipeline, x0: Tensor, level: float, packing: Packing, generator: torch.Generator | None
) -> Tensor:
    """A clean prediction [S, *] taken to time ``level`` with fresh noise: the next step's input."""
    return noised(pipe, x0, fresh_noise(x0, generator), per_sample_time(level, packing, x0), packing)


def choose_step(num_steps: int, generator: torch.Generator | None) -> int:
    """The step a training step backpropagates through, uniform over ``num_steps`` (one per pack)."""
    device = generator.device if generator is not None else None
    return int(torch.randint(num_steps, (1,), generator=generator, device=device).item())


def run_steps(
    pipe: FlowPipeline,
    student: Net,
    noise: Tensor,
    packing: Packing,
    timesteps: list[float],
    generator: torch.Generator | None,
    conditioning: Conditioning,
) -> list[Tensor]:
    """The clean predictions [S, *] of the steps at ``timesteps`` from ``noise`` (x at timesteps[0]),
    each re-noised to the next time with noise from ``generator`` (none after the last step)."""
    x, predictions = noise, []
    for index, t in enumerate(timesteps):
        x0 = pipe.denoise(student, x, t, packing.sample_ids, **conditioning.cond)
        predictions.append(x0)
        if index + 1 < len(timesteps):
            x = renoise(pipe, x0, timesteps[index + 1], packing, generator)
    return predictions


@torch.no_grad()
def student_trajectory(
    pipe: FlowPipeline,
    student: Net,
    noise: Tensor,
    packing: Packing,
    settings: DistillSettings,
    generator: torch.Generator | None = None,
    conditioning: Conditioning | None = None,
) -> list[Tensor]:
    """Generation with the student (inference, no grad): the clean prediction [S, *] after each of
    ``settings.student_timesteps``; the last one is the sample. ``noise`` [S, *] is standard normal."""
    return run_steps(
        pipe, student, noise, packing, settings.student_timesteps, generator, conditioning or Conditioning()
    )


def generate_student_sample(
    pipe: FlowPipeline,
    student: Net,
    noise: Tensor,
    packing: Packing,
    settings: DistillSettings,
    generator: torch.Generator | None = None,
    conditioning: Conditioning | None = None,
) -> StudentSample:
    """Backward simulation: pick a step uniformly, run the steps before it without grad and it with grad.

    The sample is the one ``student_trajectory`` would reach after that step from the same ``noise``
    and the same ``generator`` state past the step choice (the step index is drawn first). Only the
    chosen step keeps a graph, so memory is one network call's whatever the step count.
    """
    conditioning = conditioning or Conditioning()
    timesteps = settings.student_timesteps
    index = choose_step(len(timesteps), generator)
    with torch.no_grad():
        earlier = run_steps(pipe, student, noise, packing, timesteps[:index], generator, conditioning)
        x = noise if index == 0 else renoise(pipe, earlier[-1], timesteps[index], packing, generator)
    x0 = pipe.denoise(student, x, timesteps[index], packing.sample_ids, **conditioning.cond)
    return StudentSample(x0, index, timesteps[index])
