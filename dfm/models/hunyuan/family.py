"""HunyuanVideo 1.5's registry entry."""

from __future__ import annotations

from dfm.models.common.family import Family
from dfm.models.flux.family import flux_attention_backend
from dfm.models.hunyuan.flops import hunyuan_forward_flops
from dfm.models.hunyuan.hunyuan_model import HunyuanVideo15Model, hunyuan_layer_spec

HUNYUAN = Family(
    model=HunyuanVideo15Model,
    layer_spec=hunyuan_layer_spec,
    forward_flops=hunyuan_forward_flops,
    attention_backend=flux_attention_backend,  # the joint attention builds its own segments
)
