"""Transformer Engine core attention for our packs. Import only when TE is installed.

Our attention modules keep megatron's ``sbhd`` layout with b == 1 (so per-token 3D RoPE is
applied unchanged); TE's packed kernels want ``thd``. This wrapper squeezes b, relabels the
segment boundaries as THD and applies the segments' token order (ST-DiT temporal attention).

Context parallelism: self-attention uses TE's own THD context parallelism (megatron hands it
``cp_group`` / ``cp_global_ranks`` / ``cp_stream`` from the config); our split of a pack is the
one TE expects (chunks r and 2*cp-1-r of each sample, see context_parallel.py), and TE gets the
whole-pack cu_seqlens. Cross-attention keys are the unsplit text, which TE's CP does not model:
there TE's CP is switched off and only the queries are local. Not run in CI (no TE on CPU).
"""

from __future__ import annotations

import dataclasses

from megatron.core.extensions.transformer_engine import TEDotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from dfm.models.attention.segments import attend_in_segment_order
from dfm.parallel.layout import layout_of


class TEPackedDotProductAttention(TEDotProductAttention):
    """query [sq, 1, np, hn], key/value [sk, 1, np, hn] + segments -> [sq, 1, np*hn]."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, **kwargs):
        super().__init__(config, layer_number, attn_mask_type, attention_type, **kwargs)
        self.local_queries_only = attention_type == "cross" and layout_of(config).cp > 1
        if self.local_queries_only:
            self.set_context_parallel_group(None, None, None, "p2p")

    def forward(
        self,
        query,
        key,
        value,
        attention_mask=None,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
        **kwargs,
    ):
        mask_type = attn_mask_type or AttnMaskType.no_mask
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, mask_type, attention_bias, None, **kwargs)
        if self.local_queries_only:
            packed_seq_params = packed_seq_params.context_parallel.params

        def thd_kernel(q, k, v, params):
            thd = dataclasses.replace(params, qkv_format="thd", token_order=None, context_parallel=None)
            return super(TEPackedDotProductAttention, self).forward(
                q[:, 0], k[:, 0], v[:, 0], None, mask_type, attention_bias, thd, **kwargs
            )

        out = attend_in_segment_order(thd_kernel, query, key, value, packed_seq_params)
        return out.reshape(query.shape[0], 1, -1)
