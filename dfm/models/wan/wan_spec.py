"""The Wan block's ModuleSpec on a backend's modules (local or Transformer Engine, see dit_spec.py)."""

from __future__ import annotations

import dataclasses

from megatron.core.transformer.spec_utils import ModuleSpec

from dfm.models.attention.modules import BackendModules
from dfm.models.common.adaln import AdaLNNorm
from dfm.models.common.block_specs import cross_attention_spec, mlp_spec, self_attention_spec
from dfm.models.dit.dit_layer import DiTLayerSubmodules
from dfm.models.wan.norms import AcrossHeadsRMSNorm
from dfm.models.wan.wan_layer import (
    WanCrossAttention,
    WanCrossAttentionSubmodules,
    WanLayer,
    WanModulation,
    WanSelfAttention,
)


def wan_self_attention_spec(modules: BackendModules) -> ModuleSpec:
    spec = self_attention_spec(modules, qk_layernorm=True, module=WanSelfAttention)
    spec.submodules.q_layernorm = spec.submodules.k_layernorm = AcrossHeadsRMSNorm
    return spec


def wan_cross_attention_spec(modules: BackendModules) -> ModuleSpec:
    spec = cross_attention_spec(modules)
    submodules = WanCrossAttentionSubmodules(
        **{f.name: getattr(spec.submodules, f.name) for f in dataclasses.fields(spec.submodules)},
        q_layernorm=AcrossHeadsRMSNorm,
        k_layernorm=AcrossHeadsRMSNorm,
    )
    return dataclasses.replace(spec, module=WanCrossAttention, submodules=submodules)


def wan_layer_spec(model_cfg, modules: BackendModules) -> ModuleSpec:
    """Self- and cross-attention with q/k RMSNorm across heads, a dense GELU-tanh MLP."""
    return ModuleSpec(
        module=WanLayer,
        submodules=DiTLayerSubmodules(
            adaln=WanModulation,
            self_attention=wan_self_attention_spec(modules),
            cross_attention=wan_cross_attention_spec(modules),
            mlp=mlp_spec(modules, None),
            norm=AdaLNNorm,
        ),
    )
