"""Wan 2.2 A14B's two experts: one model per side of a timestep boundary (diffusers' WanPipeline
``boundary_ratio``): ``transformer`` (the high-noise expert) denoises t >= boundary_ratio,
``transformer_2`` (the low-noise one) the rest. A run trains one of them (``model.wan_expert``) on
training times drawn on its side of the boundary only, or both (``model.wan_expert=both``: every
sample's t drawn over [0, 1], the sample routed to its t's expert, dfm/models/wan/experts.py);
sampling routes each step to its expert.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dfm.data.packed_batch import PackedBatch

EXPERTS = ("high_noise", "low_noise")
BOTH = "both"


def expert_of(level: Tensor, boundary_ratio: float) -> Tensor:
    """[N] long: 0 (high noise) where t >= boundary_ratio, 1 (low noise) below; index into EXPERTS."""
    return (level < boundary_ratio).long()


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
        high = (c_noise >= self.boundary).tolist()
        if len(set(high)) > 1:
            raise ValueError(f"a pack's samples straddle the experts' boundary {self.boundary}: {c_noise.tolist()}")
        return self.high_noise if high[0] else self.low_noise

    def forward(self, x_in: Tensor, c_noise: Tensor, batch: PackedBatch) -> Tensor:
        return self.expert(c_noise)(x_in, c_noise, batch)
