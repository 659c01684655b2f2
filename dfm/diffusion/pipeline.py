"""The interface every diffusion pipeline (EDM, flow matching) offers the trainer and the sampler.

The network is ``net(x_in [S, D], c_noise [N], **cond) -> raw [S, D]``: tokens of N samples are
packed along S and ``sample_ids [S]`` maps each token to its sample. The pipeline owns all
preconditioning; the network never sees sigma or t except through ``c_noise``.

Training is split in three pure pieces so that, under pipeline parallelism, the first stage can
build the input and the last stage the loss, each from the same (noise, level):

    noise, level = draw_training_noise(N, x0.shape, generator)      # level: sigma (EDM) or t (flow)
    x_in, c_noise = model_input(x0, noise, level, sample_ids)
    per_sample = training_loss(net(x_in, c_noise, **cond), x0, noise, level, sample_ids, loss_mask)
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from dfm.data.pack_draws import DRAW_INTO  # level_draw_kinds' names -> the in-place draws
from dfm.data.packed_batch import segment_lengths
from dfm.diffusion.packed_loss import masked_mean_per_sample
from dfm.diffusion.samplers import Churn, Sampler, classifier_free_guidance, sampler_for

Net = Callable[..., torch.Tensor]
Shape = Sequence[int] | torch.Size


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    """How to sample: solver, steps, classifier-free guidance and the seed of the sampling noise."""

    steps: int
    guidance_scale: float = 1.0  # 1: the conditional prediction alone (a given uncond still runs)
    sampler: str | None = None  # None: the pipeline settings' sampler
    seed: int = 0  # the CPU generator of the starting noise (for a shape) and of EDM's churn
    shift: float | None = None  # flow matching only: overrides the settings' shift
    # Two guidance scales split at a noise level (WanPipeline's guidance_scale_2 for Wan 2.2 A14B's
    # low-noise expert): levels >= guidance_boundary (flow: t) use guidance_scale, lower ones
    # guidance_scale_2. None: guidance_scale at every level.
    guidance_scale_2: float | None = None
    guidance_boundary: float | None = None
    # Flow matching only: the times of the steps from 1 (noise) down, used as given (no shift), with 0
    # appended; ``steps`` must be their count. A DMD2 student's distill.student_timesteps
    # (dfm/inference/student.py). None: ``steps`` times of the shifted uniform schedule.
    timesteps: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.timesteps is not None and len(self.timesteps) != self.steps:
            raise ValueError(f"steps={self.steps} but {len(self.timesteps)} timesteps were given: {self.timesteps}")

    def guidance_at(self, level: float) -> float:
        """The guidance scale of the step at ``level`` (sigma or t)."""
        if self.guidance_scale_2 is None or self.guidance_boundary is None or level >= self.guidance_boundary:
            return self.guidance_scale
        return self.guidance_scale_2

    @property
    def guided(self) -> bool:
        """Whether any step needs the unconditional pass (a scale other than 1)."""
        return self.guidance_scale != 1.0 or self.guidance_scale_2 not in (None, 1.0)


class SamplingSchedule(NamedTuple):
    """What a pipeline hands the solver: the field it integrates over ``levels``, from noise of std
    ``start_std``, with EDM's churn (ignored by the deterministic solvers)."""

    field: Callable[..., torch.Tensor]  # (net, x, level [N], sample_ids, **cond) -> [S, *]
    levels: list[float]
    start_std: float = 1.0
    churn: Churn = Churn()


class DiffusionPipeline(ABC):
    """Noising, preconditioning, loss and sampling of one diffusion formulation."""

    name: str  # 'edm' | 'flow': the config's model.pipeline, and the key of its samplers
    settings: Any  # the formulation's settings dataclass (its ``sampler`` is the default)

    def sampler(self, name: str | None = None) -> Sampler:
        """The sampler ``name`` (None: the settings' default) of this pipeline."""
        return sampler_for(self.name, name or self.settings.sampler)

    @abstractmethod
    def level_draw_kinds(self) -> tuple[str, ...]:
        """What ``level_draws`` draws, in order: "normal" (standard normals) or "uniform" (on [0, 1))."""

    def level_draws(self, num_samples: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, ...]:
        """The random numbers ``num_samples`` training levels are made from, each [N], in the order drawn."""
        device = generator.device if generator is not None else None
        return tuple(
            DRAW_INTO[kind](torch.empty(num_samples, device=device), generator=generator)
            for kind in self.level_draw_kinds()
        )

    @abstractmethod
    def levels_from_draws(
        self, draws: tuple[torch.Tensor, ...], tokens: float | list[int] | None = None
    ) -> torch.Tensor:
        """[N] fp32 training noise levels (sigma for EDM, t for flow) from ``level_draws``; ``tokens``:
        one number, or one per sample, for a level distribution that depends on the sample's size."""

    def draw_level(
        self, num_samples: int, generator: torch.Generator | None = None, tokens: float | None = None
    ) -> torch.Tensor:
        """[N] fp32 training noise levels drawn from ``generator``."""
        return self.levels_from_draws(self.level_draws(num_samples, generator), tokens)

    def draw_training_noise(
        self,
        num_samples: int,
        shape: Shape,
        generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (noise [S, *] standard normal of ``shape``, level [N]); level first, then noise."""
        level = self.draw_level(num_samples, generator, tokens=shape[0] / num_samples)
        gen_device = generator.device if generator is not None else None
        noise = torch.randn(tuple(shape), generator=generator, device=gen_device, dtype=dtype)
        return noise.to(device or noise.device), level.to(device or level.device)

    @abstractmethod
    def model_input(
        self, x0: torch.Tensor, noise: torch.Tensor, level: torch.Tensor, sample_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (x_in [S, *], c_noise [N])."""

    @abstractmethod
    def squared_error(self, raw_out: Tensor, x0: Tensor, noise: Tensor, level: Tensor, sample_ids: Tensor) -> Tensor:
        """Per token and feature, fp32 [S, *]: the squared error of the formulation's prediction."""

    @abstractmethod
    def validation_levels(self, bins: int) -> list[float]:
        """One fixed noise level per bin, low noise to high: the levels validation's loss is measured
        at (the same every evaluation, so evaluations compare)."""

    def loss_weight(self, level: Tensor) -> Tensor | None:
        """Per-sample loss weight [N] at ``level``; None: unit weight."""
        return None

    def training_loss(
        self,
        raw_out: torch.Tensor,
        x0: torch.Tensor,
        noise: torch.Tensor,
        level: torch.Tensor,
        sample_ids: torch.Tensor,
        loss_mask: torch.Tensor,
    ) -> torch.Tensor:
        """-> per-sample loss [N] (fp32): masked mean over real tokens and features, times the weight."""
        squared_error = self.squared_error(raw_out, x0, noise, level, sample_ids)
        per_sample = masked_mean_per_sample(squared_error, sample_ids, loss_mask, level.numel())
        weight = self.loss_weight(at_least_fp32(level))
        return per_sample if weight is None else weight * per_sample

    @abstractmethod
    def denoise(
        self, net: Net, x: torch.Tensor, level: torch.Tensor | float, sample_ids: torch.Tensor, **cond: Any
    ) -> torch.Tensor:
        """-> x0_hat [S, *], the model's estimate of clean data from ``x`` at noise ``level``."""

    @abstractmethod
    def sampling_schedule(self, options: SamplingOptions) -> SamplingSchedule:
        """The field, levels, starting std and churn that ``sample`` integrates for ``options``."""

    @torch.no_grad()
    def sample(
        self,
        net: Net,
        noise: torch.Tensor | Shape,
        sample_ids: torch.Tensor,
        options: SamplingOptions,
        cond: dict[str, Any] | None = None,
        uncond: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        """Generate clean samples [S, *] from standard-normal ``noise`` [S, *] (or noise drawn for a
        shape from ``options.seed``); guidance acts on the integrated field (EDM: D; flow: v)."""
        generator = torch.Generator().manual_seed(options.seed)
        schedule = self.sampling_schedule(options)
        field = guided_field(schedule.field, net, sample_ids, cond, uncond, options.guidance_at)
        x = at_least_fp32(initial_noise(noise, generator)) * schedule.start_std  # integrate in >= fp32
        return self.sampler(options.sampler).run(field, x, schedule.levels, schedule.churn, generator)

    def loss_for(
        self,
        net: Net,
        x0: torch.Tensor,
        sample_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        generator: torch.Generator | None = None,
        num_samples: int | None = None,
        **cond: Any,
    ) -> torch.Tensor:
        """All three training pieces chained (single-stage training): -> per-sample loss [N]."""
        if num_samples is None:
            num_samples = count_samples(sample_ids)
        # fp32 noise whatever x0's dtype: the loss rebuilds x from it in fp32.
        noise, level = self.draw_training_noise(num_samples, x0.shape, generator, x0.device)
        x_in, c_noise = self.model_input(x0, noise, level, sample_ids)
        raw_out = net(x_in, c_noise, **cond)
        return self.training_loss(raw_out, x0, noise, level, sample_ids, loss_mask)


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """Losses and noising in fp32 (or fp64 when given), whatever the activations' dtype."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def per_sample_level(level: torch.Tensor | float, x: torch.Tensor, sample_ids: torch.Tensor) -> torch.Tensor:
    """Sigma or t as [N], in at least fp32 and at least the precision of ``x``, from [N] or a scalar."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    if isinstance(level, torch.Tensor):
        dtype = torch.promote_types(dtype, level.dtype)
    level = torch.as_tensor(level, dtype=dtype, device=x.device)
    return level.expand(count_samples(sample_ids)) if level.dim() == 0 else level


def count_samples(sample_ids: torch.Tensor) -> int:
    """N for ids 0..N-1 (syncs with the device once; pass N explicitly in hot loops)."""
    return int(sample_ids.max().item()) + 1 if sample_ids.numel() else 0


def initial_noise(
    noise: torch.Tensor | Shape, generator: torch.Generator | None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Standard-normal starting noise: ``noise`` itself, or drawn from ``generator`` for a shape."""
    if isinstance(noise, torch.Tensor):
        return noise
    device = generator.device if generator is not None else None
    return torch.randn(tuple(noise), generator=generator, device=device, dtype=dtype)


def guided(
    predict: Callable[[dict[str, Any]], torch.Tensor],
    cond: dict[str, Any] | None,
    uncond: dict[str, Any] | None,
    guidance_scale: float,
) -> torch.Tensor:
    """Classifier-free guidance around one prediction: uncond + s (cond - uncond).

    ``predict(kwargs)`` runs the model with the given conditioning. Without ``uncond`` this is the
    conditional prediction (no guidance); with it the formula is always applied, so s = 1 costs an
    extra forward pass but equals the conditional prediction.
    """
    cond_out = predict(cond or {})
    if uncond is None:
        return cond_out
    return classifier_free_guidance(cond_out, predict(uncond), guidance_scale)


def guided_field(
    predict_at: Callable[..., torch.Tensor],
    net: Net,
    sample_ids: torch.Tensor,
    cond: dict[str, Any] | None,
    uncond: dict[str, Any] | None,
    guidance_at: Callable[[float], float],
) -> Callable[[torch.Tensor, float], torch.Tensor]:
    """The field a sampler integrates: ``(x [S, *], level) -> predict_at(net, x, level per sample, ...)``
    with classifier-free guidance (EDM: the denoiser at sigma; flow: the velocity at t) of scale
    ``guidance_at(level)`` (``SamplingOptions.guidance_at``)."""
    num_samples = count_samples(sample_ids)  # one device sync, not one per step

    def field(x: torch.Tensor, level: float) -> torch.Tensor:
        per_sample = torch.full((num_samples,), level, dtype=x.dtype, device=x.device)
        return guided(
            lambda kwargs: predict_at(net, x, per_sample, sample_ids, **kwargs), cond, uncond, guidance_at(level)
        )

    return field


# ---------------------------------------------------------------------------------------------
# Conditioning dropout (shared by all pipelines)
# ---------------------------------------------------------------------------------------------


def cfg_drop_mask(num_samples: int, prob: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """[N] bool, True where a sample's text is replaced by the null embedding."""
    device = generator.device if generator is not None else None
    return torch.rand(num_samples, generator=generator, device=device) < prob


def null_dropped_context(
    context: torch.Tensor, cu_seqlens_kv_padded: torch.Tensor, dropped: torch.Tensor
) -> torch.Tensor:
    """Zero (the null embedding) every text token of the ``dropped [N]`` samples of ``context [S_kv, D]``."""
    lengths = segment_lengths(cu_seqlens_kv_padded).long()
    if int(lengths.sum()) != context.shape[0]:
        raise ValueError(
            f"cu_seqlens_kv_padded covers {int(lengths.sum())} text tokens but context has {context.shape[0]}; "
            "pass the padded offsets"
        )
    token_dropped = torch.repeat_interleave(dropped.to(lengths.device), lengths).to(context.device)
    return context.masked_fill(token_dropped[:, None], 0.0)  # one pass: no zeros tensor to select from


def apply_cfg_dropout(
    context: torch.Tensor,
    cu_seqlens_kv_padded: torch.Tensor,
    prob: float,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Drop each sample's text with probability ``prob`` (deterministic given ``generator``).

    context: [S_kv, D] packed text; cu_seqlens_kv_padded: [N+1] segment offsets, [-1] == S_kv.
    """
    num_samples = cu_seqlens_kv_padded.numel() - 1
    if prob <= 0:
        return context
    return null_dropped_context(context, cu_seqlens_kv_padded, cfg_drop_mask(num_samples, prob, generator))
