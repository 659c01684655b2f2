"""Transformer Engine core attention for our packs. Import only when TE is installed.

Our attention modules keep megatron's ``sbhd`` layout with b == 1 (so per-token 3D RoPE is
applied unchanged); TE's packed kernels want ``thd``. This wrapper squeezes b and relabels
the segment boundaries as THD, nothing else.
"""

from __future__ import annotations

import dataclasses

from megatron.core.extensions.transformer_engine import TEDotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class TEPackedDotProductAttention(TEDotProductAttention):
    """query [sq, 1, np, hn], key/value [sk, 1, np, hn] + segments -> [sq, 1, np*hn]."""

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        mask_type = attn_mask_type or AttnMaskType.no_mask
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, mask_type, attention_bias, None, **kwargs)
        thd = dataclasses.replace(packed_seq_params, qkv_format="thd")
        out = super().forward(query[:, 0], key[:, 0], value[:, 0], None, mask_type, attention_bias, thd, **kwargs)
        return out.reshape(query.shape[0], 1, -1)
