"""The adaLN final layer (DiT's, FLUX's ``norm_out`` + ``proj_out``): tokens -> patch features."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from dfm.models.common.adaln import AdaLNNorm
from dfm.models.common.init import zero_init
from dfm.models.common.norm_recompute import norm_modulate_rows
from dfm.models.common.row_modulation import RowLayout


class FinalLayer(nn.Module):
    """adaLN-modulated norm + linear to patch features; zero-initialised as in DiT."""

    def __init__(self, hidden_size: int, out_features: int, eps: float, norm: type = AdaLNNorm):
        super().__init__()
        self.norm = norm(hidden_size, eps)
        self.adaln = zero_init(nn.Linear(hidden_size, 2 * hidden_size))
        self.linear = zero_init(nn.Linear(hidden_size, out_features))

    def forward(self, hidden: Tensor, cond: Tensor, token_sample_ids: Tensor, per_row: RowLayout = 0) -> Tensor:
        """hidden [s, b, h], cond [N, h], token_sample_ids [s] -> [s, b, out]. The norm and modulation as
        in the blocks (norm_recompute.py): each sample's shift / scale row reaches its tokens inside the
        op (``per_row``: runs of whole samples in order, rows broadcast; row_modulation.py)."""
        shift, scale = self.adaln(F.silu(cond)).chunk(2, dim=-1)
        rms = isinstance(self.norm, nn.RMSNorm)
        return self.linear(norm_modulate_rows(hidden, shift, scale, token_sample_ids, self.norm.eps, rms, per_row))
