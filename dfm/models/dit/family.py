"""The DiT family's registry entry: dit_adaln, dit_cross, stdit and moviegen on one model class."""

from __future__ import annotations

from typing import Any

from dfm.models.common.family import Family
from dfm.models.common.fused import activation
from dfm.models.dit.dit_flops import dit_forward_flops
from dfm.models.dit.dit_model import DiTModel
from dfm.models.dit.dit_spec import dit_layer_spec
from dfm.parallel.layout import ParallelLayout


def dit_transformer_settings(model_cfg) -> dict[str, Any]:
    """moviegen: Llama-style blocks (RMSNorm, SwiGLU, no linear biases)."""
    if model_cfg.architecture != "moviegen":
        return {}
    return {
        "normalization": "RMSNorm",
        "gated_linear_unit": True,
        "activation_func": activation(gated=True, compile=model_cfg.compile),
        "add_bias_linear": False,
    }


def dit_attention_backend(model_cfg, backend: str, layout: ParallelLayout, varlen_ok: bool) -> str:
    if backend == "te" and model_cfg.architecture == "stdit" and layout.cp > 1:
        # The all-to-all re-sharding wraps the local kernels; TE's CP splits per-sample segments only.
        raise NotImplementedError(
            f"stdit with {layout.key('cp')} > 1 runs on the local attention backends, not te: "
            "set model.attention_backend=flex or sdpa"
        )
    return backend


DIT = Family(
    model=DiTModel,
    layer_spec=dit_layer_spec,
    forward_flops=dit_forward_flops,
    transformer_settings=dit_transformer_settings,
    attention_backend=dit_attention_backend,
)
