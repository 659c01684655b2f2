"""The DiT block on megatron-core modules: modulate, attend, gate.

    x = x + gate_msa * SelfAttn(modulate(norm1(x), shift_msa, scale_msa))
    x = x + CrossAttn(norm2(x), text)                        # text-conditioned variant only
    x = x + gate_mlp * MLP(modulate(norm3(x), shift_mlp, scale_mlp))

Attention, MLP and modulation are built from a ``ModuleSpec`` (local or Transformer Engine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from torch import Tensor

from dfm.models.common.adaln import AdaLNNorm, modulate


@dataclass
class DiTLayerSubmodules:
    adaln: Union[ModuleSpec, type]
    self_attention: Union[ModuleSpec, type]
    mlp: Union[ModuleSpec, type]
    cross_attention: Optional[Union[ModuleSpec, type]] = None


def _add_bias(output_and_bias: tuple[Tensor, Optional[Tensor]]) -> Tensor:
    output, bias = output_and_bias
    return output if bias is None else output + bias


class DiTLayer(MegatronModule):
    """One DiT block. hidden [s, b, h] -> [s, b, h]."""

    def __init__(self, config, submodules: DiTLayerSubmodules, layer_number: int = 1):
        super().__init__(config=config)
        self.layer_number = layer_number
        h, eps = config.hidden_size, config.layernorm_epsilon
        self.adaln = build_module(submodules.adaln, config=config, num_chunks=6)
        self.norm1 = AdaLNNorm(h, eps)
        self.self_attention = build_module(submodules.self_attention, config=config, layer_number=layer_number)
        self.cross_attention = None
        if submodules.cross_attention is not None:
            self.norm2 = AdaLNNorm(h, eps)
            self.cross_attention = build_module(submodules.cross_attention, config=config, layer_number=layer_number)
        self.norm3 = AdaLNNorm(h, eps)
        self.mlp = build_module(submodules.mlp, config=config, ffn_hidden_size=config.ffn_hidden_size)

    def forward(
        self,
        hidden: Tensor,
        cond: Tensor,
        token_sample_ids: Tensor,
        context: Optional[Tensor],
        rotary_pos_emb: Optional[Tensor],
        self_attn_params: PackedSeqParams,
        cross_attn_params: Optional[PackedSeqParams],
    ) -> Tensor:
        """hidden [s, b, h]; cond [N, h] per sample; token_sample_ids [s]; context [s_kv, b, h]."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaln(cond, token_sample_ids)
        attn_in = modulate(self.norm1(hidden), shift_msa, scale_msa)
        attn_out = self.self_attention(
            attn_in, attention_mask=None, rotary_pos_emb=rotary_pos_emb, packed_seq_params=self_attn_params
        )
        hidden = hidden + gate_msa * _add_bias(attn_out)
        if self.cross_attention is not None:
            cross_out = self.cross_attention(
                self.norm2(hidden), attention_mask=None, key_value_states=context, packed_seq_params=cross_attn_params
            )
            hidden = hidden + _add_bias(cross_out)
        mlp_out = self.mlp(modulate(self.norm3(hidden), shift_mlp, scale_mlp))
        return hidden + gate_mlp * _add_bias(mlp_out)
