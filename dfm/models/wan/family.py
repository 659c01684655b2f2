"""Wan 2.1's registry entry."""

from __future__ import annotations

from typing import Any

from dfm.models.common.family import Family
from dfm.models.wan.experts import wan_model
from dfm.models.wan.flops import wan_forward_flops
from dfm.models.wan.wan_spec import wan_layer_spec


def wan_transformer_settings(model_cfg) -> dict[str, Any]:
    # megatron sums the grads of q/k norms over TP, as if they were per head and replicated: Wan's
    # are across heads and TP-sharded (dfm/models/wan/norms.py), so its spec adds them instead.
    # Wan rotates channel pairs (2i, 2i+1).
    return {"qk_layernorm": False, "rotary_interleaved": True}


WAN = Family(
    model=wan_model,
    layer_spec=wan_layer_spec,
    forward_flops=wan_forward_flops,
    transformer_settings=wan_transformer_settings,
)
