"""The adaLN final layer (DiT's, FLUX's ``norm_out`` + ``proj_out``): tokens -> patch features."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from dfm.models.common.adaln import AdaLNNorm, modulate, rows_to_tokens
from dfm.models.common.init import zero_init
from dfm.models.common.row_modulation import by_row


class FinalLayer(nn.Module):
    """adaLN-modulated norm + linear to patch features; zero-initialised as in DiT."""

    def __init__(self, hidden_size: int, out_features: int, eps: float, norm: type = AdaLNNorm):
        super().__init__()
        self.norm = norm(hidden_size, eps)
        self.adaln = zero_init(nn.Linear(hidden_size, 2 * hidden_size))
        self.linear = zero_init(nn.Linear(hidden_size, out_features))

    def forward(self, hidden: Tensor, cond: Tensor, token_sample_ids: Tensor, per_row: int = 0) -> Tensor:
        """hidden [s, b, h], cond [N, h] -> [s, b, out]. ``per_row`` > 0: the tokens are N runs of that
        many in sample order, so each sample's row broadcasts over its run (no per-token copy, whose
        gather and index_add backward cost ~0.6 ms a step on the digits-video rung's 2048 tokens)."""
        rows = self.adaln(F.silu(cond))
        if per_row:
            normed = self.norm(hidden)
            shift, scale = rows[:, None, None].chunk(2, dim=-1)
            return self.linear(modulate(by_row(normed, per_row), shift, scale).view_as(normed))
        shift, scale = rows_to_tokens(rows, token_sample_ids).unsqueeze(1).chunk(2, dim=-1)
        return self.linear(modulate(self.norm(hidden), shift, scale))
