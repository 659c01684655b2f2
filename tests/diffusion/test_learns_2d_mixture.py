"""End to end: a small MLP trained with each pipeline learns a 2-D mixture of 8 Gaussians.

Each 2-D point is one token of its own sample (sample_ids = arange), so this exercises the same
draw_training_noise / model_input / training_loss / sample path a DiT uses, with c_noise as an
input feature of the net.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from dfm.diffusion import SamplingOptions, apply_cfg_dropout, build_pipeline

NUM_MODES = 8
NUM_CLASSES = 2  # conditional test: the upper and lower half of the circle
RADIUS = 1.0
MODE_STD = 0.08
DATA_STD = math.sqrt(RADIUS**2 / 2 + MODE_STD**2)  # per coordinate

# Thresholds on 4000 generated points. With a perfect sampler a mode's frequency has a standard
# error of 0.005 and a mode's mean of 0.004, so these bound the model's error, not the noise.
FREQUENCY_TOL = 0.04  # |frequency - 1/8| per mode
MEAN_TOL = 0.06  # distance of a mode's sample mean from its centre
MIN_NEAR_MODE = 0.90  # fraction within 4 mode stds of some centre
STD_RATIO = (0.7, 1.4)  # spread around its centre vs MODE_STD (an untrained-at-low-noise net gives ~2)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/diffusion/conftest.py


def mode_centres() -> torch.Tensor:
    angles = torch.arange(NUM_MODES) * 2 * math.pi / NUM_MODES
    return RADIUS * torch.stack([angles.cos(), angles.sin()], dim=1)


def draw_data(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (points [n, 2], mode index [n])."""
    modes = torch.randint(NUM_MODES, (n,), generator=generator)
    return mode_centres()[modes] + MODE_STD * torch.randn(n, 2, generator=generator), modes


def class_context(modes: torch.Tensor) -> torch.Tensor:
    """One "text token" per sample: one-hot of the half-circle (modes 0-3 vs 4-7); zeros is null."""
    return nn.functional.one_hot(modes // (NUM_MODES // 2), NUM_CLASSES).float()


class NoiseConditionedMLP(nn.Module):
    """raw [S, 2] = MLP(Fourier features of x_in and of c_noise, context [S, C]); one token per sample.

    Fourier features of the position let a small MLP represent the sharp, mode-sized structure the
    low-noise targets have (a plain MLP stays near the smooth mean for thousands of steps).
    """

    def __init__(self, hidden: int = 128, frequencies: int = 6, context_dim: int = 0) -> None:
        super().__init__()
        self.context_dim = context_dim
        self.register_buffer("freqs", 2.0 ** torch.arange(frequencies, dtype=torch.float32))
        # fourier(x_in) + fourier(c_noise) + context
        in_features = (2 + 2 * 2 * frequencies) + (1 + 2 * frequencies) + context_dim
        self.net = nn.Sequential(
            nn.Linear(in_features, hidden),
            nn.SiLU(),
            nn.Linear(hidden, hidden),
            nn.SiLU(),
            nn.Linear(hidden, hidden),
            nn.SiLU(),
            nn.Linear(hidden, 2),
        )

    def fourier(self, v: torch.Tensor) -> torch.Tensor:
        """[S, k] -> [S, k + 2 k F]: v and sin/cos of v at each frequency."""
        angles = (v[:, :, None] * self.freqs).flatten(1)
        return torch.cat([v, angles.sin(), angles.cos()], dim=1)

    def forward(self, x_in: torch.Tensor, c_noise: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        features = [self.fourier(x_in), self.fourier(c_noise[:, None])]
        if self.context_dim:
            features.append(context if context is not None else x_in.new_zeros(len(x_in), self.context_dim))
        return self.net(torch.cat(features, dim=1))


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 1000
    batch: int = 512
    lr: float = 3e-3
    conditional: bool = False
    cfg_drop_prob: float = 0.0


def train(pipe, settings: TrainSettings, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    net = NoiseConditionedMLP(context_dim=NUM_CLASSES if settings.conditional else 0)
    opt = torch.optim.Adam(net.parameters(), lr=settings.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, settings.steps)
    data_gen, noise_gen = torch.Generator().manual_seed(seed + 1), torch.Generator().manual_seed(seed + 2)
    drop_gen = torch.Generator().manual_seed(seed + 3)
    n = settings.batch
    sample_ids, loss_mask = torch.arange(n), torch.ones(n)
    cu_seqlens_kv = torch.arange(n + 1, dtype=torch.int32)  # one context token per sample
    for _ in range(settings.steps):
        x0, modes = draw_data(n, data_gen)
        cond = {}
        if settings.conditional:
            cond["context"] = apply_cfg_dropout(class_context(modes), cu_seqlens_kv, settings.cfg_drop_prob, drop_gen)
        loss = pipe.loss_for(net, x0, sample_ids, loss_mask, noise_gen, num_samples=n, **cond).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return net.eval()


def mixture_report(samples: torch.Tensor) -> dict[str, float]:
    distances = torch.cdist(samples, mode_centres())
    nearest_distance, nearest = distances.min(dim=1)
    frequencies = torch.bincount(nearest, minlength=NUM_MODES).float() / len(samples)
    near = nearest_distance < 4 * MODE_STD
    mean_errors, stds = [], []
    for k in range(NUM_MODES):
        in_mode = samples[near & (nearest == k)]
        mean_errors.append((in_mode.mean(0) - mode_centres()[k]).norm().item())
        stds.append((in_mode - mode_centres()[k]).std().item())
    return {
        "max_frequency_error": (frequencies - 1 / NUM_MODES).abs().max().item(),
        "max_mean_error": max(mean_errors),
        "near_mode_fraction": near.float().mean().item(),
        "min_std_ratio": min(stds) / MODE_STD,
        "max_std_ratio": max(stds) / MODE_STD,
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, settings, sampler, steps",
    [
        ("edm", {"sigma_data": DATA_STD}, "heun", 32),
        ("flow", {"timestep_sampling": "logit_normal"}, "euler", 64),
        ("flow", {"timestep_sampling": "uniform"}, "heun", 32),
    ],
)
def test_trained_pipeline_samples_the_mixture(name, settings, sampler, steps):
    pipe = build_pipeline(name, **settings)
    net = train(pipe, TrainSettings())
    n = 4000
    samples = pipe.sample(net, (n, 2), torch.arange(n), SamplingOptions(steps, sampler=sampler, seed=9))
    report = mixture_report(samples)
    assert report["max_frequency_error"] < FREQUENCY_TOL, report
    assert report["max_mean_error"] < MEAN_TOL, report
    assert report["near_mode_fraction"] > MIN_NEAR_MODE, report
    assert STD_RATIO[0] < report["min_std_ratio"] and report["max_std_ratio"] < STD_RATIO[1], report


# ---------------------------------------------------------------------------------------------
# Classifier-free guidance, learned: condition on the half-circle, drop it 20% of the time
# ---------------------------------------------------------------------------------------------


def fraction_in_class(samples: torch.Tensor, label: int) -> float:
    nearest = torch.cdist(samples, mode_centres()).argmin(dim=1)
    return (nearest // (NUM_MODES // 2) == label).float().mean().item()


def near_mode_fraction(samples: torch.Tensor) -> float:
    return (torch.cdist(samples, mode_centres()).min(dim=1).values < 4 * MODE_STD).float().mean().item()


@pytest.mark.slow
def test_cfg_dropout_training_gives_conditional_and_unconditional_model():
    pipe = build_pipeline("flow", timestep_sampling="uniform")
    net = train(pipe, TrainSettings(conditional=True, cfg_drop_prob=0.2))
    n, label = 4000, 1
    want = {"context": class_context(torch.full((n,), label * NUM_MODES // 2))}
    null = {"context": torch.zeros(n, NUM_CLASSES)}

    def draw(cond, uncond=None, guidance_scale=1.0):
        options = SamplingOptions(32, guidance_scale, sampler="heun", seed=9)
        return pipe.sample(net, (n, 2), torch.arange(n), options, cond, uncond)

    unconditional, conditional = draw(cond=null), draw(cond=want)
    guided = draw(cond=want, uncond=null, guidance_scale=3.0)
    # The null context learned the whole mixture; the label picks its half; guidance sharpens it.
    assert abs(fraction_in_class(unconditional, label) - 0.5) < 0.08
    assert fraction_in_class(conditional, label) > 0.93
    per_mode = torch.bincount(torch.cdist(conditional, mode_centres()).argmin(dim=1), minlength=NUM_MODES) / n
    half = NUM_MODES // 2
    assert (per_mode[label * half : (label + 1) * half] > 0.15).all(), per_mode  # no collapse inside the class
    assert fraction_in_class(guided, label) > max(0.98, fraction_in_class(conditional, label))
    assert near_mode_fraction(guided) > MIN_NEAR_MODE
