"""Layer specs for every architecture, for two backends that differ only in their modules.

* local: megatron-core parallel linears + ``PackedDotProductAttention`` (torch SDPA / flex).
* te: Transformer Engine linears and THD attention, imported only when asked for.

Parameter names are the same in both, so a checkpoint moves between them.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
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

from dfm.models.common.adaln import AdaLNModulation, AdaLNNorm, AdaLNRMSNorm, QKRMSNorm
from dfm.models.common.packed_attention import PackedDotProductAttention
from dfm.models.dit.dit_layer import DiTLayer, DiTLayerSubmodules, STDiTLayer


@dataclass(frozen=True)
class BackendModules:
    column_linear: type
    row_linear: type
    core_attention: ModuleSpec
    use_te: bool


def local_modules(attention_backend: str = "sdpa") -> BackendModules:
    core = ModuleSpec(module=PackedDotProductAttention, params={"backend": attention_backend})
    return BackendModules(ColumnParallelLinear, RowParallelLinear, core, use_te=False)


def te_modules() -> BackendModules:
    """Transformer Engine modules; raises ImportError when TE is not installed."""
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TERowParallelLinear

    from dfm.models.common.te_attention import TEPackedDotProductAttention

    return BackendModules(
        TEColumnParallelLinear, TERowParallelLinear, ModuleSpec(module=TEPackedDotProductAttention), True
    )


def self_attention_spec(modules: BackendModules, qk_layernorm: bool) -> ModuleSpec:
    qk_norm = QKRMSNorm if qk_layernorm else None
    return ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.no_mask},
        submodules=SelfAttentionSubmodules(
            linear_qkv=modules.column_linear,
            core_attention=modules.core_attention,
            linear_proj=modules.row_linear,
            q_layernorm=qk_norm,
            k_layernorm=qk_norm,
        ),
    )


def cross_attention_spec(modules: BackendModules) -> ModuleSpec:
    return ModuleSpec(
        module=CrossAttention,
        params={"attn_mask_type": AttnMaskType.no_mask},
        submodules=CrossAttentionSubmodules(
            linear_q=modules.column_linear,
            linear_kv=modules.column_linear,
            core_attention=modules.core_attention,
            linear_proj=modules.row_linear,
        ),
    )


def mlp_spec(modules: BackendModules, num_moe_experts: int | None) -> ModuleSpec:
    """Dense MLP (GELU, or SwiGLU when the config is gated) or a megatron MoE layer."""
    if num_moe_experts:
        return get_moe_module_spec(use_te=modules.use_te, num_experts=num_moe_experts, moe_grouped_gemm=False)
    return ModuleSpec(
        module=MLP, submodules=MLPSubmodules(linear_fc1=modules.column_linear, linear_fc2=modules.row_linear)
    )


def dit_layer_spec(
    architecture: str, modules: BackendModules, qk_layernorm: bool, num_moe_experts: int | None = None
) -> ModuleSpec:
    """The block of ``architecture`` (dit_adaln | dit_cross | stdit | moviegen) on ``modules``."""
    stdit = architecture == "stdit"
    return ModuleSpec(
        module=STDiTLayer if stdit else DiTLayer,
        submodules=DiTLayerSubmodules(
            adaln=AdaLNModulation,
            self_attention=self_attention_spec(modules, qk_layernorm),
            mlp=mlp_spec(modules, num_moe_experts),
            cross_attention=None if architecture == "dit_adaln" else cross_attention_spec(modules),
            temporal_attention=self_attention_spec(modules, qk_layernorm) if stdit else None,
            norm=AdaLNRMSNorm if architecture == "moviegen" else AdaLNNorm,
        ),
    )
