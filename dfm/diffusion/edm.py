"""EDM: Karras, Aittala, Aila, Laine, "Elucidating the Design Space of Diffusion-Based Generative
Models" (NeurIPS 2022). Formulas follow Table 1 ("Ours" column); names follow the paper.

    x = x0 + sigma n,          ln sigma ~ N(P_mean, P_std^2)
    D(x; sigma) = c_skip(sigma) x + c_out(sigma) F(c_in(sigma) x; c_noise(sigma))
    loss = lambda(sigma) || D(x; sigma) - x0 ||^2
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from dfm.diffusion.packed_loss import per_token
from dfm.diffusion.pipeline import (
    DiffusionPipeline,
    Net,
    SamplingOptions,
    SamplingSchedule,
    at_least_fp32,
    per_sample_level,
)
from dfm.diffusion.samplers import Churn, karras_sigmas, sampler_for


@dataclass
class EDMSettings:
    P_mean: float = -1.2  # training: ln sigma ~ N(P_mean, P_std^2)
    P_std: float = 1.2
    sigma_data: float = 0.5  # std of the (latent) data
    sigma_min: float = 0.002  # sampling schedule
    sigma_max: float = 80.0
    rho: float = 7.0
    S_churn: float = 0.0  # stochastic sampling (Algorithm 2); 0 = deterministic
    S_min: float = 0.0
    S_max: float = float("inf")
    S_noise: float = 1.0
    sampler: str = "heun"

    def __post_init__(self) -> None:
        sampler_for(EDMPipeline.name, self.sampler)
        if not 0 < self.sigma_min < self.sigma_max:
            raise ValueError(f"need 0 < sigma_min < sigma_max, got {self.sigma_min}, {self.sigma_max}")
        if self.sigma_data <= 0 or self.P_std <= 0:
            raise ValueError("sigma_data and P_std must be positive")


class Preconditioning(NamedTuple):
    c_skip: torch.Tensor
    c_out: torch.Tensor
    c_in: torch.Tensor
    c_noise: torch.Tensor


class EDMPipeline(DiffusionPipeline):
    name = "edm"

    def __init__(self, settings: EDMSettings | None = None) -> None:
        self.settings = settings or EDMSettings()

    # --- Table 1 -------------------------------------------------------------------------------

    def preconditioning(self, sigma: torch.Tensor) -> Preconditioning:
        """Per-sample scalings for ``sigma [N]`` (each result [N])."""
        sd = self.settings.sigma_data
        return Preconditioning(
            c_skip=sd**2 / (sigma**2 + sd**2),
            c_out=sigma * sd / (sigma**2 + sd**2).sqrt(),
            c_in=1 / (sigma**2 + sd**2).sqrt(),
            c_noise=sigma.log() / 4,
        )

    def loss_weight(self, sigma: torch.Tensor) -> torch.Tensor:
        """lambda(sigma) = (sigma^2 + sd^2) / (sigma sd)^2 = 1 / c_out^2: unit weight on F's target."""
        sd = self.settings.sigma_data
        return (sigma**2 + sd**2) / (sigma * sd) ** 2

    def draw_sigma(self, num_samples: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """[N] fp32 training noise levels, log-normal: ln sigma ~ N(P_mean, P_std^2)."""
        return self.levels_from_draws(self.level_draws(num_samples, generator))

    # --- training pieces -------------------------------------------------------------------------

    def level_draw_kinds(self) -> tuple[str, ...]:
        """ln sigma is made from one standard normal."""
        return ("normal",)

    def levels_from_draws(
        self, draws: tuple[torch.Tensor, ...], tokens: float | list[int] | None = None
    ) -> torch.Tensor:
        return (self.settings.P_mean + self.settings.P_std * draws[0]).exp()

    def validation_levels(self, bins: int) -> list[float]:
        """The training distribution's quantiles at the bins' centres: sigma = exp(P_mean + P_std z_k),
        z_k = Phi^-1((k + 1/2) / bins)."""
        z = torch.special.ndtri((torch.arange(bins, dtype=torch.float64) + 0.5) / bins)
        return (self.settings.P_mean + self.settings.P_std * z).exp().tolist()

    def noisy(
        self, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor, sample_ids: torch.Tensor
    ) -> torch.Tensor:
        """x = x0 + sigma n, in fp32 ([S, *])."""
        return at_least_fp32(x0) + per_token(at_least_fp32(sigma), sample_ids, x0) * at_least_fp32(noise)

    def model_input(
        self, x0: torch.Tensor, noise: torch.Tensor, level: torch.Tensor, sample_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (c_in x [S, *] in x0's dtype, c_noise [N])."""
        c = self.preconditioning(at_least_fp32(level))
        x = self.noisy(x0, noise, level, sample_ids)
        return (per_token(c.c_in, sample_ids, x) * x).to(x0.dtype), c.c_noise

    def squared_error(self, raw_out: Tensor, x0: Tensor, noise: Tensor, level: Tensor, sample_ids: Tensor) -> Tensor:
        """(D(x; sigma) - x0)^2, fp32 [S, *]; the loss weighs sample i's mean by lambda(sigma_i)."""
        sigma = at_least_fp32(level)
        c = self.preconditioning(sigma)
        x = self.noisy(x0, noise, sigma, sample_ids)
        denoised = per_token(c.c_skip, sample_ids, x) * x + per_token(c.c_out, sample_ids, x) * at_least_fp32(raw_out)
        return (denoised - at_least_fp32(x0)) ** 2

    # --- inference -------------------------------------------------------------------------------

    def denoise(
        self, net: Net, x: torch.Tensor, level: torch.Tensor | float, sample_ids: torch.Tensor, **cond: Any
    ) -> torch.Tensor:
        """D(x; sigma) = c_skip x + c_out F(c_in x; c_noise). x: [S, *]; sigma: [N] or a scalar."""
        # At least fp32 for the scalings: c_skip -> 1 and c_out -> 0 at small sigma.
        sigma = per_sample_level(level, x, sample_ids)
        x = x.to(sigma.dtype)
        c = self.preconditioning(sigma)
        raw = net(per_token(c.c_in, sample_ids, x) * x, c.c_noise, **cond)
        return per_token(c.c_skip, sample_ids, x) * x + per_token(c.c_out, sample_ids, x) * raw.to(x.dtype)

    def sampling_schedule(self, options: SamplingOptions) -> SamplingSchedule:
        """The denoiser D(x; sigma) from sigma_max to 0 on the rho schedule (eq. 5), churn per Algorithm 2."""
        if options.shift is not None:
            raise ValueError(f"shift={options.shift} is a flow-matching option; the EDM pipeline has no shift")
        if options.timesteps is not None:
            raise ValueError("timesteps are flow-matching times; the EDM pipeline samples on its sigma schedule")
        s = self.settings
        sigmas = karras_sigmas(options.steps, s.sigma_min, s.sigma_max, s.rho)
        return SamplingSchedule(self.denoise, sigmas, sigmas[0], Churn(s.S_churn, s.S_min, s.S_max, s.S_noise))
