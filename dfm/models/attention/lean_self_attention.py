"""megatron's fused-qkv SelfAttention (same parameters) that keeps less for backward.

* RoPE from ``RotaryTables``: cos / sin made once per pack and shared by every layer (an angles
  tensor [s, 1, 1, d], as megatron takes it, still works: its tables are made per call).
* q / k RMSNorm and RoPE in one Function (qk_norm_rope.py): the normed q and k are recomputed in
  backward, not kept beside their inputs; without RoPE (absolute positions) the norm alone, one
  fused kernel instead of RMSNorm's composite ops.
* RoPE without q / k norms: the value is copied out of the fused QKV output, which is then freed
  (a view of it would keep all three of q, k, v alive beside the rotated q and k).
* On the CPU the q / k / v this module makes (normed, rotated, copied) are laid out heads-major, where
  SDPA's flash kernel reads them faster (heads_layout.py); the values are the same.

* megatron's forward without its inference / offload branches for a plain call (lean_forward.py).

Values are megatron's: the same norm kernel and the same RoPE products, in the same dtype.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.attention import SelfAttention
from torch import Tensor, nn

from dfm.models.attention.heads_layout import heads_major, heads_major_copy, made_heads_major, token_major
from dfm.models.attention.lean_forward import PlainAttentionForward
from dfm.models.attention.qk_norm_rope import qk_norm_rope
from dfm.models.attention.rope_tables import WRITTEN_BY_CHANNEL_SET, RotaryTables, apply_rotary


def as_tables(rotary_pos_emb: Tensor | RotaryTables | None, interleaved: bool) -> RotaryTables | None:
    """The pack's tables, or tables for a bare angles tensor [s, 1, 1, d]."""
    if rotary_pos_emb is None or isinstance(rotary_pos_emb, RotaryTables):
        return rotary_pos_emb
    return RotaryTables(rotary_pos_emb, interleaved)


def fusable_norm(norm) -> bool:
    """A per-head RMSNorm with a weight and an explicit eps (QKRMSNorm)."""
    return isinstance(norm, nn.RMSNorm) and norm.weight is not None and norm.eps is not None


class LeanSelfAttention(PlainAttentionForward, SelfAttention):
    """hidden [s, b, h] -> ([s, b, h], bias), like SelfAttention; ``rotary_pos_emb`` may be RotaryTables."""

    rotary: RotaryTables | None = None

    def forward(self, hidden_states: Tensor, attention_mask=None, rotary_pos_emb=None, **kwargs):
        # RoPE is applied here, in get_query_key_value_tensors: megatron's forward sees no rotary input.
        self.rotary = as_tables(rotary_pos_emb, self.config.rotary_interleaved)
        try:
            return super().forward(hidden_states, attention_mask, rotary_pos_emb=None, **kwargs)
        finally:
            self.rotary = None

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True):
        """query [sq, b, np, hn], key / value [sq, b, ng, hn] (+ gate), RoPE applied to query and key."""
        fused = (
            split_qkv
            and not output_gate
            and self.config.num_query_groups >= self.world_size
            and fusable_norm(self.q_layernorm)
            and fusable_norm(self.k_layernorm)
        )
        if not fused:
            outputs = super().get_query_key_value_tensors(hidden_states, key_value_states, output_gate, split_qkv)
            if self.rotary is None or not split_qkv:
                return outputs
            cos, sin = self.rotary.cos_sin(outputs[0].dtype)
            query, key = (self.rotated(t, cos, sin) for t in outputs[:2])
            value = outputs[2]
            if self.q_layernorm is None and self.k_layernorm is None:
                # RoPE keeps only cos / sin: once the value leaves the fused QKV output, it is freed.
                # The copy made heads-major on the CPU, where SDPA's flash kernel reads it faster (heads_layout.py).
                value = heads_major_copy(value) if made_heads_major(value) else value.contiguous()
            return (query, key, value, *outputs[3:])
        mixed_qkv, split_sizes = super().get_query_key_value_tensors(hidden_states, key_value_states, split_qkv=False)
        query, key, value = torch.split(mixed_qkv, split_sizes, dim=3)
        query = query.reshape(query.size(0), query.size(1), -1, self.hidden_size_per_attention_head)
        return self.norm_rope(query, self.q_layernorm), self.norm_rope(key, self.k_layernorm), value

    def rotated(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """RoPE of x [s, b, np, hn] (differentiable). A large x's rotation writes its own output: on the CPU
        it is written heads-major (heads_layout.py), no copy added; a small one's follows x's layout."""
        interleaved = self.rotary.interleaved
        if made_heads_major(x) and x.numel() >= WRITTEN_BY_CHANNEL_SET:
            return token_major(apply_rotary(heads_major(x), heads_major(cos), heads_major(sin), interleaved))
        return apply_rotary(x, cos, sin, interleaved)

    def norm_rope(self, x: Tensor, norm: nn.RMSNorm) -> Tensor:
        """RMSNorm (+ RoPE when the pack has tables) of x [s, b, np, hn] in one Function."""
        if self.rotary is None:
            return qk_norm_rope(x, norm.weight, None, None, norm.eps, False)
        cos, sin = self.rotary.cos_sin(x.dtype)
        return qk_norm_rope(x, norm.weight, cos, sin, norm.eps, self.rotary.interleaved)
