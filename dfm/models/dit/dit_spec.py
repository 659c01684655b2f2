"""The DiT-family blocks (dit_adaln | dit_cross | stdit | moviegen) as ModuleSpecs on a backend's
modules (local or Transformer Engine, dfm/models/attention/modules.py)."""

from __future__ import annotations

from megatron.core.transformer.spec_utils import ModuleSpec

from dfm.models.attention.lean_self_attention import LeanSelfAttention
from dfm.models.attention.modules import BackendModules
from dfm.models.common.adaln import AdaLNNorm, AdaLNRMSNorm
from dfm.models.common.block_specs import cross_attention_spec, mlp_spec, self_attention_spec
from dfm.models.common.row_modulation import AdaLNRows
from dfm.models.dit.dit_layer import DiTLayer, DiTLayerSubmodules, STDiTLayer


def dit_layer_spec(model_cfg, modules: BackendModules) -> ModuleSpec:
    """The block of ``model_cfg.architecture`` on ``modules``."""
    architecture, qk_layernorm = model_cfg.architecture, model_cfg.qk_layernorm
    stdit = architecture == "stdit"
    return ModuleSpec(
        module=STDiTLayer if stdit else DiTLayer,
        submodules=DiTLayerSubmodules(
            adaln=AdaLNRows,
            self_attention=self_attention_spec(modules, qk_layernorm, LeanSelfAttention),
            mlp=mlp_spec(modules, model_cfg.num_moe_experts),
            cross_attention=None if architecture == "dit_adaln" else cross_attention_spec(modules),
            temporal_attention=self_attention_spec(modules, qk_layernorm, LeanSelfAttention) if stdit else None,
            norm=AdaLNRMSNorm if architecture == "moviegen" else AdaLNNorm,
        ),
    )
