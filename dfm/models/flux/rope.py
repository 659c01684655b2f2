"""FLUX's rotary embedding: per-axis frequencies over (t, h, w) ids, channel pairs interleaved.

Channels (2i, 2i + 1) of a head form one rotated pair (diffusers' ``apply_rotary_emb`` with
``use_real_unbind_dim=-1``), not halves as in megatron's default. Text tokens have ids (0, 0, 0),
i.e. no rotation, so only image tokens are rotated. The rotation itself is the per-head q / k
norm's (``dfm.models.attention.qk_norm_rope``): with these fp32 tables it rotates in fp32 and rounds
to the heads' dtype, as diffusers does.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rope_cos_sin(pos_ids: Tensor, axes_dim: list[int], theta: float = 10000.0) -> tuple[Tensor, Tensor]:
    """pos_ids [s, 3] -> (cos, sin) [s, 1, 1, sum(axes_dim)] fp32, each pair's angle repeated twice.

    Angles are taken in float64 then rounded, as diffusers does, so positions far from 0 keep
    their precision."""
    angles = []
    for axis, dim in enumerate(axes_dim):
        inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=pos_ids.device) / dim)
        angles.append(pos_ids[:, axis].float().double()[:, None] * inv_freq[None])
    angle = torch.cat(angles, dim=-1).repeat_interleave(2, dim=-1)[:, None, None, :]
    return angle.cos().float(), angle.sin().float()
