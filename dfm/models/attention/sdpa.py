"""The reference backend: torch SDPA on each sample's segment (``sdpa``), exact on every device."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

from dfm.models.attention.segments import segment_bounds


def sdpa_per_segment(query: Tensor, key: Tensor, value: Tensor, params: PackedSeqParams, scale: float) -> Tensor:
    """query [sq, b, np, hn], key/value [sk, b, np, hn] -> [sq, b, np, hn]; padding rows are 0."""
    out = torch.zeros_like(query)
    q_starts, q_lens = segment_bounds(params, "q")
    kv_starts, kv_lens = segment_bounds(params, "kv")
    for q0, nq, k0, nk in zip(q_starts, q_lens, kv_starts, kv_lens):
        if nq == 0 or nk == 0:
            continue
        q = query[q0 : q0 + nq].permute(1, 2, 0, 3)  # [b, np, nq, hn]
        k = key[k0 : k0 + nk].permute(1, 2, 0, 3)
        v = value[k0 : k0 + nk].permute(1, 2, 0, 3)
        out[q0 : q0 + nq] = F.scaled_dot_product_attention(q, k, v, scale=scale).permute(2, 0, 1, 3)
    return out
