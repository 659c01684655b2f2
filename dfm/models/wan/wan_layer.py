"""The Wan 2.1 block: the DiT block (dfm/models/dit/dit_layer.py) with Wan's pieces.

    x = x + gate_msa * SelfAttn(modulate(norm1(x), shift_msa, scale_msa))   # q/k RMSNorm across heads, 3D RoPE
    x = x + CrossAttn(norm2(x), text)                                       # affine norm2, q/k RMSNorm across heads
    x = x + gate_mlp * MLP(modulate(norm3(x), shift_mlp, scale_mlp))        # GELU-tanh

The six modulations are the model's shared timestep projection plus each block's learned
``scale_shift_table`` (WanModulation), not a per-block adaLN linear. As in the DiT block they stay
one row per conditioning row (a sample, or a TI2V sample's clean first frame) and tokens take their
row inside the norm-modulate and gated-residual ops; the q / k norms across heads (and RoPE) keep
only their input and a per-token variance (qk_norm.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region
from megatron.core.transformer.attention import CrossAttentionSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from torch import Tensor, nn

from dfm.models.attention.lean_forward import PlainCrossAttention
from dfm.models.attention.lean_self_attention import LeanSelfAttention
from dfm.models.common.init import normal_init
from dfm.models.common.row_modulation import ModulationRows
from dfm.models.dit.dit_layer import DiTLayer, DiTLayerSubmodules
from dfm.models.wan.norms import SequenceParallelLayerNorm

# Wan's per-sample conditioning rows: the timestep embedding (the output head's), then the six
# block modulations (shift, scale, gate of attention and of the MLP) of the shared time_proj.
TEMB_ROW, NUM_BLOCK_MODULATIONS = 0, 6


class WanModulation(MegatronModule):
    """cond [R, 7, h] -> 6 x ModulationRows: time_proj rows + this block's scale_shift_table, per row."""

    def __init__(self, config, num_chunks: int = NUM_BLOCK_MODULATIONS):
        super().__init__(config=config)
        self.num_chunks = num_chunks
        self.scale_shift_table = nn.Parameter(torch.empty(1, num_chunks, config.hidden_size, dtype=config.params_dtype))
        normal_init(self)

    def forward(self, cond: Tensor, token_row_ids: Tensor, tokens_per_sample: int = 0) -> tuple[ModulationRows, ...]:
        """cond [R, 7, h] (R: N samples + the timestep-0 row), token_row_ids [s] (each token's row of
        cond: its sample's, or the timestep-0 row for a clean first frame's token) -> num_chunks x
        ModulationRows (rows [R, h]): tokens take their row inside the block's ops (row_modulation.py).
        The rows are not one a sample (the timestep-0 row), so they are always gathered by id:
        ``tokens_per_sample`` is not used."""
        per_row = (self.scale_shift_table + cond[:, TEMB_ROW + 1 :]).flatten(1)
        if self.config.sequence_parallel:
            # Each TP rank modulates only its tokens: sum the grads of the table and of time_proj over TP.
            per_row = copy_to_tensor_model_parallel_region(per_row)
        return tuple(ModulationRows(rows, token_row_ids) for rows in per_row.chunk(self.num_chunks, dim=-1))


class WanSelfAttention(LeanSelfAttention):
    """LeanSelfAttention (same parameters) whose q / k norms across heads apply RoPE too, one Function
    each (qk_norm.py): the normed and the weighted q / k are not kept beside the QKV output."""

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True):
        """query [sq, b, np, hn], key / value [sq, b, np, hn]: normalised across heads, then rotated."""
        if self.rotary is None or output_gate or not split_qkv or self.config.num_query_groups < self.world_size:
            return super().get_query_key_value_tensors(hidden_states, key_value_states, output_gate, split_qkv)
        mixed_qkv, split_sizes = super().get_query_key_value_tensors(hidden_states, key_value_states, split_qkv=False)
        query, key, value = torch.split(mixed_qkv, split_sizes, dim=3)
        query = query.reshape(query.size(0), query.size(1), -1, self.hidden_size_per_attention_head)
        return self.q_layernorm(query, self.rotary), self.k_layernorm(key, self.rotary), value


@dataclass
class WanCrossAttentionSubmodules(CrossAttentionSubmodules):
    q_layernorm: ModuleSpec | type | None = None
    k_layernorm: ModuleSpec | type | None = None


class WanCrossAttention(PlainCrossAttention):
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
