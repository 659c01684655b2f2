"""Wan's output head: affine-free norm, shift / scale from its own table plus the timestep embedding."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dfm.models.common.adaln import AdaLNNorm, modulate, rows_to_tokens
from dfm.models.common.init import normal_init
from dfm.models.wan.wan_layer import TEMB_ROW


class WanHead(nn.Module):
    """hidden [s, b, h], cond [N, 7, h] -> [s, b, out]: proj_out(norm_out(x) * (1 + scale) + shift)."""

    def __init__(self, hidden_size: int, out_features: int, eps: float):
        super().__init__()
        self.norm = AdaLNNorm(hidden_size, eps)
        self.scale_shift_table = nn.Parameter(torch.empty(1, 2, hidden_size))
        self.linear = nn.Linear(hidden_size, out_features)
        normal_init(self)

    def forward(self, hidden: Tensor, cond: Tensor, token_sample_ids: Tensor, tokens_per_sample: int = 0) -> Tensor:
        """``token_sample_ids`` are Wan's conditioning rows (a clean first frame reads its own row, not its
        sample's), so the rows are always gathered: ``tokens_per_sample`` is not used (as in the blocks)."""
        per_sample = (self.scale_shift_table + cond[:, TEMB_ROW : TEMB_ROW + 1]).flatten(1)  # [N, 2h]
        shift, scale = rows_to_tokens(per_sample, token_sample_ids).unsqueeze(1).chunk(2, dim=-1)
        return self.linear(modulate(self.norm(hidden), shift, scale))
