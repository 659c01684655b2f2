"""Wan 2.2 A14B's two experts: one model per side of a timestep boundary (diffusers' WanPipeline
``boundary_ratio``): ``transformer`` (the high-noise expert) denoises t >= boundary_ratio,
``transformer_2`` (the low-noise one) the rest. A run trains one of them (``model.wan_expert``) on
training times drawn on its side of the boundary only, or both (``model.wan_expert=both``: every
sample's t drawn over [0, 1], the sample routed to its t's expert, dfm/models/wan/experts.py);
sampling routes each step to its expert (``TimestepExperts``, also over a both-run's two experts).

One rule decides which expert serves a level: ``expert_of`` (t >= boundary: high noise). Training
applies it to the drawn t, sampling to the network's c_noise with the boundary mapped by the run's
own pipeline (``c_noise_boundary``: flow.c_noise_scale * boundary_ratio), never by a constant.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dfm.data.packed_batch import PackedBatch

EXPERTS = ("high_noise", "low_noise")
BOTH = "both"


def expert_of(level: Tensor, boundary: float) -> Tensor:
    """[N] long: 0 (high noise) where level >= boundary, 1 (low noise) below; index into EXPERTS.
    ``level`` and ``boundary`` in one unit: t and boundary_ratio, or c_noise and ``c_noise_boundary``."""
    return (level < boundary).long()


def c_noise_boundary(pipeline, boundary_ratio: float) -> float:
    """The boundary t = ``boundary_ratio`` in the network's c_noise units, by the pipeline's own map
    (flow: ``flow.c_noise_scale * t``; 1000 t for Wan's recipes)."""
    return float(pipeline.c_noise(boundary_ratio))


def expert_t_range(expert: str, boundary_ratio: float) -> tuple[float, float]:
    """(t_min, t_max) of the expert's training times."""
    if expert not in EXPERTS:
        raise ValueError(f"unknown model.wan_expert {expert!r}; valid: {', '.join(EXPERTS)}")
    return (boundary_ratio, 1.0) if expert == "high_noise" else (0.0, boundary_ratio)


def expert_flow_settings(model_cfg, flow_settings: dict) -> dict:
    """``flow_settings`` (the flow section as a dict) with t_min / t_max of ``model.wan_expert``'s side."""
    if model_cfg.wan_expert is None:
        return flow_settings
    if model_cfg.wan_boundary_ratio is None:
        raise ValueError(f"model.wan_expert={model_cfg.wan_expert} needs model.wan_boundary_ratio")
    if model_cfg.wan_expert == BOTH:  # each sample's t is drawn over [0, 1] and picks its expert
        return flow_settings
    if (flow_settings.get("t_min", 0.0), flow_settings.get("t_max", 1.0)) != (0.0, 1.0):
        raise ValueError(f"model.wan_expert={model_cfg.wan_expert} sets flow.t_min / flow.t_max: leave them unset")
    t_min, t_max = expert_t_range(model_cfg.wan_expert, model_cfg.wan_boundary_ratio)
    return {**flow_settings, "t_min": t_min, "t_max": t_max}


class TimestepExperts(torch.nn.Module):
    """``net(x_in [S, D], c_noise [N], batch) -> [S, D]``: the high-noise expert where the pack's
    timestep is >= ``boundary`` (in c_noise units: 1000 boundary_ratio for Wan), else the low-noise
    one. One timestep per pack, as sampling calls it (a mixed pack is refused)."""

    def __init__(self, high_noise: torch.nn.Module, low_noise: torch.nn.Module, boundary: float):
        super().__init__()
        self.high_noise, self.low_noise, self.boundary = high_noise, low_noise, boundary

    def expert(self, c_noise: Tensor) -> torch.nn.Module:
        routes = set(expert_of(c_noise, self.boundary).tolist())
        if len(routes) > 1:
            raise ValueError(f"a pack's samples straddle the experts' boundary {self.boundary}: {c_noise.tolist()}")
        return (self.high_noise, self.low_noise)[routes.pop()]

    def forward(self, x_in: Tensor, c_noise: Tensor, batch: PackedBatch) -> Tensor:
        return self.expert(c_noise)(x_in, c_noise, batch)


def sampling_net(model: torch.nn.Module, model_cfg, pipeline) -> torch.nn.Module:
    """The net that samples ``model``: a both-run's model (``model.wan_expert=both``; its training packs
    carry the routes, sampling's do not) as TimestepExperts over its two experts at the run's boundary
    in ``pipeline``'s c_noise units; any other model (one expert, a TimestepExperts) itself."""
    inner = getattr(model, "module", model)  # under DDP (validation) the wrapped model
    if model_cfg.wan_expert != BOTH or not hasattr(inner, "submodels"):
        return model
    experts = inner.submodels()
    boundary = c_noise_boundary(pipeline, model_cfg.wan_boundary_ratio)
    return TimestepExperts(experts["high_noise"], experts["low_noise"], boundary)
