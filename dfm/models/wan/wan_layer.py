"""The Wan 2.1 block: the DiT block (dfm/models/dit/dit_layer.py) with Wan's pieces.

    x = x + gate_msa * SelfAttn(modulate(norm1(x), shift_msa, scale_msa))   # q/k RMSNorm across heads, 3D RoPE
    x = x + CrossAttn(norm2(x), text)                                       # affine norm2, q/k RMSNorm across heads
    x = x + gate_mlp * MLP(modulate(norm3(x), shift_mlp, scale_mlp))        # GELU-tanh

The six modulations are the model's shared timestep projection plus each block's learned
``scale_shift_table`` (WanModulation), not a per-block adaLN linear.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region
from megatron.core.transformer.attention import CrossAttention, CrossAttentionSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from torch import Tensor, nn

from dfm.models.common.adaln import rows_to_tokens
from dfm.models.common.init import normal_init
from dfm.models.dit.dit_layer import DiTLayer, DiTLayerSubmodules
from dfm.models.wan.norms import SequenceParallelLayerNorm

# Wan's per-sample conditioning rows: the timestep embedding (the output head's), then the six
# block modulations (shift, scale, gate of attention and of the MLP) of the shared time_proj.
TEMB_ROW, NUM_BLOCK_MODULATIONS = 0, 6


class WanModulation(MegatronModule):
    """cond [N, 7, h] -> 6 x [s, 1, h]: (time_proj rows + this block's scale_shift_table), per token."""

    def __init__(self, config, num_chunks: int = NUM_BLOCK_MODULATIONS):
        super().__init__(config=config)
        self.num_chunks = num_chunks
        self.scale_shift_table = nn.Parameter(torch.empty(1, num_chunks, config.hidden_size, dtype=config.params_dtype))
        normal_init(self)

    def forward(self, cond: Tensor, token_sample_ids: Tensor) -> tuple[Tensor, ...]:
        """cond [N, 7, h], token_sample_ids [s] -> num_chunks x [s, 1, h]."""
        per_sample = (self.scale_shift_table + cond[:, TEMB_ROW + 1 :]).flatten(1)
        if self.config.sequence_parallel:
            # Each TP rank modulates only its tokens: sum the grads of the table and of time_proj over TP.
            per_sample = copy_to_tensor_model_parallel_region(per_sample)
        return rows_to_tokens(per_sample, token_sample_ids).unsqueeze(1).chunk(self.num_chunks, dim=-1)


@dataclass
class WanCrossAttentionSubmodules(CrossAttentionSubmodules):
    q_layernorm: ModuleSpec | type | None = None
    k_layernorm: ModuleSpec | type | None = None


class WanCrossAttention(CrossAttention):
    """megatron's CrossAttention with q/k norms (megatron applies them in self-attention only)."""

    def __init__(self, config, submodules: WanCrossAttentionSubmodules, layer_number: int, **kwargs):
        super().__init__(config, submodules, layer_number, **kwargs)
        head_dim, eps = self.hidden_size_per_attention_head, config.layernorm_epsilon
        self.q_layernorm = build_module(submodules.q_layernorm, hidden_size=head_dim, config=config, eps=eps)
        self.k_layernorm = build_module(submodules.k_layernorm, hidden_size=head_dim, config=config, eps=eps)

    def get_query_key_value_tensors(self, hidden_states, key_value_states, *args, **kwargs):
        """query [sq, b, np, hn], key / value [sk, b, np, hn], q and k normalised."""
        query, key, value = super().get_query_key_value_tensors(hidden_states, key_value_states, *args, **kwargs)
        return self.q_layernorm(query), self.k_layernorm(key), value


class WanLayer(DiTLayer):
    """One Wan block. hidden [s, b, h] -> [s, b, h]; norm2 is an affine LayerNorm."""

    def __init__(self, config, submodules: DiTLayerSubmodules, layer_number: int = 1):
        super().__init__(config, submodules, layer_number)
        self.norm2 = SequenceParallelLayerNorm(config.hidden_size, config.layernorm_epsilon, config.sequence_parallel)
