"""Flow matching with the straight (rectified-flow / conditional-OT) path, data at t = 0, noise at t = 1.

    x_t = (1 - t) x0 + (sigma_min + (1 - sigma_min) t) n       (Lipman et al. 2023, time reversed)
    v   = dx_t/dt = (1 - sigma_min) n - x0                       (= n - x0 for sigma_min = 0)
    t  ~ U(0, 1) or sigmoid(N(m, s^2)), then t' = shift t / (1 + (shift - 1) t)   (Esser et al. 2024, SD3)

The network predicts v from (x_t, c_noise = c_noise_scale * t); sampling integrates dx/dt = v
from t = 1 to t = 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

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
from dfm.diffusion.samplers import flow_timesteps, sampler_for, shift_timesteps

TIMESTEP_SAMPLINGS = ("uniform", "logit_normal")
# Presets of the training distribution of t (before the shift), by flow.training_mode.
TRAINING_MODES = {
    # Logit-normal draws concentrate on the middle and, shifted, high noise, where layout and motion
    # are learned (SD3; Wan): the noisier choice.
    "pretrain": {"timestep_sampling": "logit_normal", "logit_mean": 0.0, "logit_std": 1.0},
    # Every level equally often: more than twice the draws below t = 0.2 (2.3x at shift 1) than logit-normal(0, 1), the
    # low-noise end where a fine-tune's new detail lives.
    "finetune": {"timestep_sampling": "uniform"},
}


@dataclass
class FlowSettings:
    timestep_sampling: str = "logit_normal"  # training distribution of t before the shift
    logit_mean: float = 0.0  # logit_normal: logit(t) ~ N(logit_mean, logit_std^2)
    logit_std: float = 1.0
    # logit_normal: this fraction of the draws uniform instead (HunyuanVideo 1.5's fine-tuning mixes them).
    uniform_mix: float = 0.0
    shift: float = 1.0  # training and sampling; see shift_for_num_tokens for a resolution-aware value
    # Training: shift each sample's t by shift_for_num_tokens(its token count) instead of ``shift``
    # (FLUX's resolution-dependent shift; dfm's forward step draws one sample at a time).
    dynamic_shift: bool = False
    sigma_min: float = 0.0  # noise std left at t = 0
    c_noise_scale: float = 1.0  # c_noise = c_noise_scale * t; 1000 for nets built for DDPM-style steps
    sampler: str = "euler"
    # pretrain | finetune: the training distribution of t from TRAINING_MODES (its fields must then
    # be left at their defaults); None: the fields as set.
    training_mode: str | None = None
    # Training draws are mapped into [t_min, t_max] after the shift (one Wan 2.2 expert's side of its
    # boundary; model.wan_expert sets them, dfm/diffusion/timestep_experts.py).
    t_min: float = 0.0
    t_max: float = 1.0

    def __post_init__(self) -> None:
        self.apply_training_mode()
        if not 0 <= self.t_min < self.t_max <= 1:
            raise ValueError(f"need 0 <= flow.t_min < flow.t_max <= 1, got {self.t_min}, {self.t_max}")
        if self.timestep_sampling not in TIMESTEP_SAMPLINGS:
            raise ValueError(
                f"unknown timestep_sampling {self.timestep_sampling!r}; valid: {', '.join(TIMESTEP_SAMPLINGS)}"
            )
        sampler_for(FlowPipeline.name, self.sampler)
        if not 0 <= self.uniform_mix <= 1:
            raise ValueError(f"flow.uniform_mix={self.uniform_mix} must be in [0, 1]")
        if self.shift <= 0 or not 0 <= self.sigma_min < 1:
            raise ValueError(f"need shift > 0 and 0 <= sigma_min < 1, got {self.shift}, {self.sigma_min}")

    def apply_training_mode(self) -> None:
        """Set the fields of ``training_mode``'s preset; refuse one the user set to something else."""
        if self.training_mode is None:
            return
        if self.training_mode not in TRAINING_MODES:
            raise ValueError(f"unknown flow.training_mode {self.training_mode!r}; valid: {', '.join(TRAINING_MODES)}")
        defaults = {f.name: f.default for f in fields(self)}
        for key, value in TRAINING_MODES[self.training_mode].items():
            if getattr(self, key) not in (defaults[key], value):
                raise ValueError(
                    f"flow.training_mode={self.training_mode} sets flow.{key}={value!r}, but flow.{key}="
                    f"{getattr(self, key)!r} was given: set one of them"
                )
            setattr(self, key, value)


def shift_for_num_tokens(
    num_tokens: float | torch.Tensor,
    base_tokens: int = 256,
    max_tokens: int = 4096,
    base_log_shift: float = 0.5,
    max_log_shift: float = 1.15,
) -> float | torch.Tensor:
    """Resolution-dependent shift: ln(shift) is linear in the token count through the two anchors
    (base_tokens, base_log_shift) and (max_tokens, max_log_shift) (SD3/FLUX "dynamic shifting"
    defaults). More tokens carry more redundant signal, so more time is spent at high noise.
    """
    slope = (max_log_shift - base_log_shift) / (max_tokens - base_tokens)
    mu = base_log_shift + slope * (num_tokens - base_tokens)
    return mu.exp() if isinstance(mu, torch.Tensor) else math.exp(mu)


class FlowPipeline(DiffusionPipeline):
    name = "flow"

    def __init__(self, settings: FlowSettings | None = None) -> None:
        self.settings = settings or FlowSettings()

    # --- the path ---------------------------------------------------------------------------------

    def noise_scale(self, t: torch.Tensor) -> torch.Tensor:
        """sigma_min + (1 - sigma_min) t, the std of the noise in x_t."""
        return self.settings.sigma_min + (1 - self.settings.sigma_min) * t

    def interpolate(
        self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, sample_ids: torch.Tensor
    ) -> torch.Tensor:
        """x_t = (1 - t) x0 + (sigma_min + (1 - sigma_min) t) n, fp32 [S, *]; t: [N]."""
        t_tok = per_token(at_least_fp32(t), sample_ids, x0)
        return (1 - t_tok) * at_least_fp32(x0) + self.noise_scale(t_tok) * at_least_fp32(noise)

    def target_velocity(self, x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """v = (1 - sigma_min) n - x0, fp32 [S, *]."""
        return (1 - self.settings.sigma_min) * at_least_fp32(noise) - at_least_fp32(x0)

    def c_noise(self, t: torch.Tensor) -> torch.Tensor:
        return self.settings.c_noise_scale * t

    def level_draw_kinds(self) -> tuple[str, ...]:
        """A time is made from one uniform, or a logit-normal's normal (with ``uniform_mix``: then a
        uniform choosing between the two and the uniform time); ``levels_from_draws`` makes the times."""
        s = self.settings
        if s.timestep_sampling == "uniform":
            return ("uniform",)
        return ("normal",) if s.uniform_mix == 0 else ("normal", "uniform", "uniform")

    def times_from_draws(
        self, draws: tuple[torch.Tensor, ...], shift: float | torch.Tensor | None = None
    ) -> torch.Tensor:
        """[N] fp32 training times from ``level_draws``; ``shift`` (scalar or [N]) overrides the settings'."""
        s = self.settings
        if s.timestep_sampling == "uniform":
            t = draws[0]
        else:
            t = torch.sigmoid(s.logit_mean + s.logit_std * draws[0])
            if s.uniform_mix > 0:
                t = torch.where(draws[2] < s.uniform_mix, draws[1], t)
        t = shift_timesteps(t, s.shift if shift is None else shift)
        return t if (s.t_min, s.t_max) == (0.0, 1.0) else s.t_min + (s.t_max - s.t_min) * t

    def draw_t(
        self, num_samples: int, generator: torch.Generator | None = None, shift: float | torch.Tensor | None = None
    ) -> torch.Tensor:
        """[N] fp32 training times; ``shift`` (scalar or [N]) overrides the settings' shift."""
        return self.times_from_draws(self.level_draws(num_samples, generator), shift)

    # --- training pieces -------------------------------------------------------------------------

    def levels_from_draws(
        self, draws: tuple[torch.Tensor, ...], tokens: float | list[int] | None = None
    ) -> torch.Tensor:
        """With ``dynamic_shift``, t is shifted for ``tokens`` (a number, or one per sample) tokens (FLUX's
        resolution-dependent shift, each in double precision as one sample's would be)."""
        if not self.settings.dynamic_shift or tokens is None:
            return self.times_from_draws(draws)
        if isinstance(tokens, list | tuple):
            return self.times_from_draws(draws, torch.tensor([shift_for_num_tokens(float(n)) for n in tokens]))
        return self.times_from_draws(draws, shift_for_num_tokens(tokens))

    def validation_levels(self, bins: int) -> list[float]:
        """t at the centres of ``bins`` equal bins of [t_min, t_max] (loss against t, as SD3 plots it)."""
        s = self.settings
        return [s.t_min + (s.t_max - s.t_min) * (k + 0.5) / bins for k in range(bins)]

    def model_input(
        self, x0: torch.Tensor, noise: torch.Tensor, level: torch.Tensor, sample_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (x_t [S, *] in x0's dtype, c_noise [N])."""
        return self.interpolate(x0, noise, level, sample_ids).to(x0.dtype), self.c_noise(at_least_fp32(level))

    def squared_error(self, raw_out: Tensor, x0: Tensor, noise: Tensor, level: Tensor, sample_ids: Tensor) -> Tensor:
        """(v_hat - v)^2, fp32 [S, *] (unit loss weight)."""
        return (at_least_fp32(raw_out) - self.target_velocity(x0, noise)) ** 2

    # --- inference -------------------------------------------------------------------------------

    def velocity(
        self, net: Net, x: torch.Tensor, level: torch.Tensor | float, sample_ids: torch.Tensor, **cond: Any
    ) -> torch.Tensor:
        """v_hat(x_t, t) [S, *]; t: [N] or a scalar."""
        t = per_sample_level(level, x, sample_ids)
        return net(x, self.c_noise(t), **cond).to(x.dtype)

    def denoise(
        self, net: Net, x: torch.Tensor, level: torch.Tensor | float, sample_ids: torch.Tensor, **cond: Any
    ) -> torch.Tensor:
        """x0_hat = (1 - sigma_min) x_t - (sigma_min + (1 - sigma_min) t) v_hat  [S, *]."""
        t = per_sample_level(level, x, sample_ids)
        v = self.velocity(net, x, t, sample_ids, **cond)
        return (1 - self.settings.sigma_min) * x - per_token(self.noise_scale(t), sample_ids, x) * v

    def sampling_schedule(self, options: SamplingOptions) -> SamplingSchedule:
        """The velocity v from t = 1 to 0 over the shifted schedule (``options.shift`` overrides the settings'),
        or over ``options.timesteps`` as given, then 0."""
        if options.timesteps is not None:
            return SamplingSchedule(self.velocity, [*map(float, options.timesteps), 0.0])
        shift = self.settings.shift if options.shift is None else options.shift
        return SamplingSchedule(self.velocity, flow_timesteps(options.steps, shift))
