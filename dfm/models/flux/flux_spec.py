"""Layer specs of the two FLUX blocks on a backend's modules (local or Transformer Engine)."""

from __future__ import annotations

from megatron.core.transformer.spec_utils import ModuleSpec

from dfm.models.attention.modules import BackendModules
from dfm.models.common.adaln import QKRMSNorm
from dfm.models.common.block_specs import mlp_spec
from dfm.models.flux.flux_layer import FluxDoubleLayer, FluxLayerSubmodules, FluxSingleLayer


def flux_layer_specs(model_cfg, modules: BackendModules) -> tuple[ModuleSpec, ModuleSpec]:
    """(double-stream block, single-stream block)."""

    def spec(layer: type, mlp: ModuleSpec | None) -> ModuleSpec:
        return ModuleSpec(
            module=layer,
            submodules=FluxLayerSubmodules(
                column_linear=modules.column_linear,
                row_linear=modules.row_linear,
                core_attention=modules.core_attention,
                qk_norm=QKRMSNorm,
                mlp=mlp,
            ),
        )

    return spec(FluxDoubleLayer, mlp_spec(modules, None)), spec(FluxSingleLayer, None)
