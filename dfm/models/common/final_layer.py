"""The adaLN final layer (DiT's, FLUX's ``norm_out`` + ``proj_out``): tokens -> patch features."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from dfm.models.common.adaln import AdaLNNorm, modulate, rows_to_tokens
from dfm.models.common.init import zero_init


class FinalLayer(nn.Module):
    """adaLN-modulated norm + linear to patch features; zero-initialised as in DiT."""

    def __init__(self, hidden_size: int, out_features: int, eps: float, norm: type = AdaLNNorm):
        super().__init__()
        self.norm = norm(hidden_size, eps)
        self.adaln = zero_init(nn.Linear(hidden_size, 2 * hidden_size))
        self.linear = zero_init(nn.Linear(hidden_size, out_features))

    def forward(self, hidden: Tensor, cond: Tensor, token_sample_ids: Tensor) -> Tensor:
        """hidden [s, b, h], cond [N, h] -> [s, b, out]."""
        shift, scale = rows_to_tokens(self.adaln(F.silu(cond)), token_sample_ids).unsqueeze(1).chunk(2, dim=-1)
        return self.linear(modulate(self.norm(hidden), shift, scale))
