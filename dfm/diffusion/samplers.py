"""ODE/SDE solvers for sampling, written against plain closures so they know nothing of models.

EDM solvers take ``denoise(x [S, *], sigma: float) -> x0_hat [S, *]`` and integrate the
probability-flow ODE dx/dsigma = (x - D(x; sigma)) / sigma (Karras et al. 2022, eq. 3 with
sigma(t) = t, s(t) = 1). Flow solvers take ``velocity(x, t: float) -> v`` and integrate
dx/dt = v from t = 1 (noise) to t = 0 (data).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

Denoiser = Callable[[torch.Tensor, float], torch.Tensor]
VelocityField = Callable[[torch.Tensor, float], torch.Tensor]


def classifier_free_guidance(cond_out: torch.Tensor, uncond_out: torch.Tensor, scale: float) -> torch.Tensor:
    """uncond + s * (cond - uncond): s = 1 is the conditional model, s = 0 the unconditional one."""
    return uncond_out + scale * (cond_out - uncond_out)


# ---------------------------------------------------------------------------------------------
# Schedules
# ---------------------------------------------------------------------------------------------


def karras_sigmas(steps: int, sigma_min: float, sigma_max: float, rho: float) -> list[float]:
    """EDM eq. 5: sigma_i = (smax^(1/rho) + i/(N-1) (smin^(1/rho) - smax^(1/rho)))^rho, then sigma_N = 0.

    Returns ``steps + 1`` floats, decreasing from sigma_max to sigma_min, then 0.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if steps == 1:
        return [sigma_max, 0.0]
    inv_rho = 1.0 / rho
    hi, lo = sigma_max**inv_rho, sigma_min**inv_rho
    sigmas = [(hi + i / (steps - 1) * (lo - hi)) ** rho for i in range(steps)]
    return sigmas + [0.0]


def shift_timesteps(t: torch.Tensor | float, shift: float | torch.Tensor) -> torch.Tensor | float:
    """Resolution shift t' = s t / (1 + (s - 1) t) (SD3 eq. 23): s > 1 spends more time at high noise."""
    return shift * t / (1 + (shift - 1) * t)


def flow_timesteps(steps: int, shift: float = 1.0) -> list[float]:
    """``steps + 1`` times from 1 (noise) to 0 (data), uniform before the shift."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    return [float(shift_timesteps(1.0 - i / steps, shift)) for i in range(steps + 1)]


# ---------------------------------------------------------------------------------------------
# EDM solvers
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Churn:
    """Stochastic churn of EDM Algorithm 2; S_churn = 0 gives the deterministic Algorithm 1."""

    S_churn: float = 0.0
    S_min: float = 0.0
    S_max: float = float("inf")
    S_noise: float = 1.0

    def gamma(self, sigma: float, steps: int) -> float:
        if self.S_churn <= 0 or not (self.S_min <= sigma <= self.S_max):
            return 0.0
        return min(self.S_churn / steps, math.sqrt(2.0) - 1.0)


def _standard_normal_like(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    device = generator.device if generator is not None else x.device
    return torch.randn(x.shape, generator=generator, device=device, dtype=x.dtype).to(x.device)


def edm_heun(
    denoise: Denoiser,
    x: torch.Tensor,
    sigmas: list[float],
    churn: Churn = Churn(),
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """EDM Algorithm 2 (Algorithm 1 when churn is off). ``x [S, *]`` starts at noise of std sigmas[0]."""
    steps = len(sigmas) - 1
    for sigma_cur, sigma_next in itertools.pairwise(sigmas):
        # Churn: raise the noise level to sigma_hat by adding fresh noise, then take the ODE step.
        gamma = churn.gamma(sigma_cur, steps)
        sigma_hat = sigma_cur * (1 + gamma)
        if gamma > 0:
            extra_std = math.sqrt(sigma_hat**2 - sigma_cur**2)
            x = x + extra_std * churn.S_noise * _standard_normal_like(x, generator)

        d_cur = (x - denoise(x, sigma_hat)) / sigma_hat
        x_next = x + (sigma_next - sigma_hat) * d_cur
        if sigma_next > 0:
            # 2nd-order correction: average the slopes at both ends (trapezoidal rule).
            d_next = (x_next - denoise(x_next, sigma_next)) / sigma_next
            x_next = x + (sigma_next - sigma_hat) * (0.5 * d_cur + 0.5 * d_next)
        x = x_next
    return x


def edm_euler(denoise: Denoiser, x: torch.Tensor, sigmas: list[float]) -> torch.Tensor:
    """First-order Euler on the EDM probability-flow ODE (one model call per step)."""
    for sigma_cur, sigma_next in itertools.pairwise(sigmas):
        d_cur = (x - denoise(x, sigma_cur)) / sigma_cur
        x = x + (sigma_next - sigma_cur) * d_cur
    return x


# ---------------------------------------------------------------------------------------------
# Flow solvers
# ---------------------------------------------------------------------------------------------


def flow_euler(velocity: VelocityField, x: torch.Tensor, timesteps: list[float]) -> torch.Tensor:
    """Euler from timesteps[0] (= 1, noise) to timesteps[-1] (= 0, data)."""
    for t_cur, t_next in itertools.pairwise(timesteps):
        x = x + (t_next - t_cur) * velocity(x, t_cur)
    return x


def flow_heun(velocity: VelocityField, x: torch.Tensor, timesteps: list[float]) -> torch.Tensor:
    """Heun (explicit trapezoidal): two velocity calls per step, 2nd order."""
    for t_cur, t_next in itertools.pairwise(timesteps):
        dt = t_next - t_cur
        v_cur = velocity(x, t_cur)
        x_euler = x + dt * v_cur
        x = x + dt * 0.5 * (v_cur + velocity(x_euler, t_next))
    return x


# ---------------------------------------------------------------------------------------------
# Sampler names
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sampler:
    """A solver under its config name, and the network calls it makes."""

    name: str
    solve: Callable[..., torch.Tensor]  # (field, x, levels) or, stochastic, (field, x, levels, churn, generator)
    calls_per_step: int
    last_step_calls: int  # EDM's Heun skips its correction on the step to sigma = 0
    stochastic: bool = False  # takes EDM's churn and the sampling generator

    def run(
        self,
        field: Callable[[torch.Tensor, float], torch.Tensor],
        x: torch.Tensor,
        levels: list[float],
        churn: Churn = Churn(),
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Integrate ``field`` from ``x`` [S, *] over ``levels`` (sigmas or times)."""
        if self.stochastic:
            return self.solve(field, x, levels, churn, generator)
        return self.solve(field, x, levels)

    def model_calls(self, steps: int, guided: bool) -> int:
        """Network evaluations of a ``steps``-step run (twice as many with classifier-free guidance)."""
        calls = self.calls_per_step * (steps - 1) + self.last_step_calls
        return calls * (2 if guided else 1)


SAMPLERS: dict[str, dict[str, Sampler]] = {
    "edm": {
        "heun": Sampler("heun", edm_heun, calls_per_step=2, last_step_calls=1, stochastic=True),
        "euler": Sampler("euler", edm_euler, calls_per_step=1, last_step_calls=1),
    },
    "flow": {
        "euler": Sampler("euler", flow_euler, calls_per_step=1, last_step_calls=1),
        "heun": Sampler("heun", flow_heun, calls_per_step=2, last_step_calls=2),
    },
}


def sampler_for(pipeline: str, name: str) -> Sampler:
    """The sampler ``name`` of ``pipeline`` ('edm' | 'flow'); a clear error for an unknown name."""
    samplers = SAMPLERS[pipeline]
    if name not in samplers:
        raise ValueError(f"unknown {pipeline}.sampler {name!r}; valid: {', '.join(samplers)}")
    return samplers[name]
