"""megatron's ``Attention.forward`` for the calls training and sampling make, without its other branches.

megatron's forward serves KV-cache inference, flash decode, fused-QKV RoPE, activation offloading and
output gates besides the plain call: each call walks those checks, NVTX ranges and context managers
(0.4-0.7 % of the digits-video rung's step on the CPU, alternated A/Bs). A plain call (none of
those asked for) runs here as megatron would run it: q / k / v from ``get_query_key_value_tensors``,
the core attention (checkpointed when the config says), the output projection. Anything else goes to
megatron's forward unchanged.
"""

from __future__ import annotations

from megatron.core.transformer.attention import CrossAttention
from torch import Tensor


class PlainAttentionForward:
    """Mixin placed before megatron's ``SelfAttention`` / ``CrossAttention``: hidden [sq, b, h] -> ([sq, b, h], bias)."""

    def forward(  # noqa: PLR0913 - megatron's signature
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        key_value_states: Tensor | None = None,
        rotary_pos_emb=None,
        attention_bias: Tensor | None = None,
        packed_seq_params=None,
        **rest,
    ):
        if rotary_pos_emb is not None or any(value is not None for value in rest.values()) or not self.is_plain():
            return super().forward(
                hidden_states,
                attention_mask,
                key_value_states=key_value_states,
                rotary_pos_emb=rotary_pos_emb,
                attention_bias=attention_bias,
                packed_seq_params=packed_seq_params,
                **rest,
            )
        query, key, value = self.get_query_key_value_tensors(hidden_states, key_value_states)
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if thd:  # megatron's THD kernels take [t, np, hn]
            query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
        if self.checkpoint_core_attention and self.training:
            attend = self._checkpointed_attention_forward
        else:
            attend = self.core_attention
        out = attend(
            query,
            key,
            value,
            attention_mask,
            attn_mask_type=self.attn_mask_type,
            attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
        )
        if thd:
            out = out.reshape(out.size(0), 1, -1)
        return self.linear_proj(out)

    def is_plain(self) -> bool:
        """Nothing megatron's forward does beyond the plain call is configured."""
        config = self.config
        return not (
            config.attention_output_gate
            or config.flash_decode
            or (config.fused_single_qkv_rope and self.attention_type != "cross")
            or self.offload_qkv_linear
            or self.offload_core_attention
            or self.offload_attn_proj
        )


class PlainCrossAttention(PlainAttentionForward, CrossAttention):
    """megatron's CrossAttention (same parameters), plain calls run by ``PlainAttentionForward``."""
