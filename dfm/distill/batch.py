"""The pack and the conditioning the distillation pieces are handed, grouped so that calls stay short."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from dfm.diffusion.pipeline import count_samples


@dataclass(frozen=True)
class Packing:
    """Which sample each token of a pack ``[S, *]`` belongs to (the pipelines' packed convention)."""

    sample_ids: Tensor  # [S] long, 0..N-1
    loss_mask: Tensor  # [S] 1 on real tokens, 0 on padding
    num_samples: int  # N

    @classmethod
    def unpadded(cls, sample_ids: Tensor) -> Packing:
        """Every token real; N from the ids (one device sync)."""
        return cls(sample_ids, torch.ones_like(sample_ids, dtype=torch.float32), count_samples(sample_ids))


@dataclass(frozen=True)
class Conditioning:
    """Keyword arguments of the network calls: ``cond`` always, ``uncond`` for the teacher's guidance."""

    cond: dict[str, Any] = field(default_factory=dict)
    uncond: dict[str, Any] | None = None  # None: the teacher runs conditionally only (no guidance)


def real_elements(packing: Packing, like: Tensor) -> Tensor:
    """[N] fp32: real tokens times features per token of each sample of ``like [S, *]`` (the count
    ``masked_mean_per_sample`` divides by)."""
    mask = packing.loss_mask.to(device=like.device, dtype=torch.float32)
    tokens = torch.zeros(packing.num_samples, dtype=mask.dtype, device=like.device)
    tokens = tokens.index_add(0, packing.sample_ids.to(like.device), mask)
    return tokens * (like[0].numel() if like.dim() > 1 else 1)


def on_real_tokens(values: Tensor, packing: Packing) -> Tensor:
    """``values [S, *]`` with padding tokens set to 0 (where(), so a NaN there does not survive)."""
    real = (packing.loss_mask > 0).to(values.device).reshape(-1, *([1] * (values.dim() - 1)))
    return torch.where(real, values, torch.zeros_like(values))
