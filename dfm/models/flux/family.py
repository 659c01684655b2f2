"""FLUX.1's registry entry."""

from __future__ import annotations

from dfm.models.common.family import Family
from dfm.models.flux.flops import flux_forward_flops
from dfm.models.flux.flux_model import FluxModel
from dfm.models.flux.flux_spec import flux_layer_specs
from dfm.parallel.layout import ParallelLayout


def flux_attention_backend(model_cfg, backend: str, layout: ParallelLayout, varlen_ok: bool) -> str:
    """FLUX's joint attention builds its own segments for the local kernels (joint_attention.py)."""
    if backend != "te":
        return backend
    if model_cfg.attention_backend == "te":
        raise NotImplementedError("flux runs on the local attention backends: set model.attention_backend=auto")
    return "varlen" if varlen_ok else "flex"


FLUX = Family(
    model=FluxModel,
    layer_spec=flux_layer_specs,
    forward_flops=flux_forward_flops,
    attention_backend=flux_attention_backend,
)
