"""Layer specs for the DiT block: local (megatron-core linears + torch attention) and TE."""

from __future__ import annotations

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import (
    CrossAttention,
    CrossAttentionSubmodules,
    SelfAttention,
    SelfAttentionSubmodules,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from dfm.models.common.adaln import AdaLNModulation, QKRMSNorm
from dfm.models.common.packed_attention import PackedDotProductAttention
from dfm.models.dit.dit_layer import DiTLayer, DiTLayerSubmodules


def local_core_attention(backend: str) -> ModuleSpec:
    return ModuleSpec(module=PackedDotProductAttention, params={"backend": backend})


def dit_layer_local_spec(cross_attention: bool, qk_layernorm: bool, attention_backend: str = "sdpa") -> ModuleSpec:
    """DiT block with megatron-core parallel linears and a torch attention kernel."""
    core = local_core_attention(attention_backend)
    qk_norm = QKRMSNorm if qk_layernorm else None
    self_attention = ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.no_mask},
        submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=core,
            linear_proj=RowParallelLinear,
            q_layernorm=qk_norm,
            k_layernorm=qk_norm,
        ),
    )
    cross = None
    if cross_attention:
        cross = ModuleSpec(
            module=CrossAttention,
            params={"attn_mask_type": AttnMaskType.no_mask},
            submodules=CrossAttentionSubmodules(
                linear_q=ColumnParallelLinear,
                linear_kv=ColumnParallelLinear,
                core_attention=core,
                linear_proj=RowParallelLinear,
            ),
        )
    mlp = ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    return ModuleSpec(
        module=DiTLayer,
        submodules=DiTLayerSubmodules(
            adaln=AdaLNModulation, self_attention=self_attention, mlp=mlp, cross_attention=cross
        ),
    )
