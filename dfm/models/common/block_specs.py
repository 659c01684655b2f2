"""ModuleSpecs of the megatron pieces blocks are built from (attention, MLP), on a backend's modules."""

from __future__ import annotations

from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.transformer.attention import CrossAttentionSubmodules, SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from dfm.models.attention.lean_forward import PlainCrossAttention
from dfm.models.attention.modules import BackendModules
from dfm.models.common.activation_mlp import ActivationMLP
from dfm.models.common.adaln import QKRMSNorm


def self_attention_spec(modules: BackendModules, qk_layernorm: bool, module: type = SelfAttention) -> ModuleSpec:
    """Fused-qkv self-attention, q / k RMS-normalised per head when ``qk_layernorm``; ``module``:
    SelfAttention or a subclass with its parameters (LeanSelfAttention)."""
    qk_norm = QKRMSNorm if qk_layernorm else None
    submodules = SelfAttentionSubmodules(
        modules.column_linear, modules.core_attention, modules.row_linear, q_layernorm=qk_norm, k_layernorm=qk_norm
    )
    return ModuleSpec(module=module, params={"attn_mask_type": AttnMaskType.no_mask}, submodules=submodules)


def cross_attention_spec(modules: BackendModules) -> ModuleSpec:
    """Queries from the hidden states, keys / values from the text context (megatron's CrossAttention)."""
    submodules = CrossAttentionSubmodules(
        modules.column_linear, modules.column_linear, modules.core_attention, modules.row_linear
    )
    return ModuleSpec(
        module=PlainCrossAttention, params={"attn_mask_type": AttnMaskType.no_mask}, submodules=submodules
    )


def mlp_spec(modules: BackendModules, num_moe_experts: int | None) -> ModuleSpec:
    """Dense MLP (GELU, or SwiGLU when the config is gated: dfm/models/common/activation_mlp.py) or a
    megatron MoE layer."""
    if num_moe_experts:
        return get_moe_module_spec(use_te=modules.use_te, num_experts=num_moe_experts, moe_grouped_gemm=False)
    return ModuleSpec(
        module=ActivationMLP, submodules=MLPSubmodules(linear_fc1=modules.column_linear, linear_fc2=modules.row_linear)
    )
