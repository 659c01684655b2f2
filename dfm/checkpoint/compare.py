"""Resume refuses a model that differs from the checkpoint's in anything that shapes its weights.

Parallel sizes may differ (checkpoints reshard); architecture, width, depth, channels, patch
sizes and experts may not: such weights would load into the wrong places or not at all.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dfm.config.container import ModelConfig

ARCHITECTURE_KEYS = (
    "architecture",
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "ffn_hidden_size",
    "in_channels",
    "out_channels",
    "patch_spatial",
    "patch_temporal",
    "text_embed_dim",
    "qk_layernorm",
    "pos_embedding",
    "num_classes",
    "num_moe_experts",
    "moe_ffn_hidden_size",
)


def resolved(model: dict[str, Any]) -> dict[str, Any]:
    """The architecture keys with defaults filled in (``None`` sizes as the model builds them)."""
    values = {**dataclasses.asdict(ModelConfig()), **model}
    config = ModelConfig(**{k: values[k] for k in ARCHITECTURE_KEYS + ("max_latent_thw",)})
    keys = {k: getattr(config, k) for k in ARCHITECTURE_KEYS}
    keys["ffn_hidden_size"] = config.effective_ffn_hidden_size
    keys["out_channels"] = config.out_channels if config.out_channels is not None else config.in_channels
    if config.pos_embedding == "learned3d":  # sizes the learned position tables
        keys["max_latent_thw"] = list(config.max_latent_thw)
    # Both Wan 2.2 experts in one model (their weights under high_noise. / low_noise.) or one model.
    keys["wan_expert"] = "both" if values.get("wan_expert") == "both" else "one model (not both)"
    return keys


def model_differences(saved: dict[str, Any], current: ModelConfig) -> list[str]:
    """``"model.<key>: checkpoint <old>, this run <new>"`` for each architecture key that differs."""
    before, now = resolved(saved), resolved(dataclasses.asdict(current))
    return [
        f"model.{key}: checkpoint {before.get(key)!r}, this run {now.get(key)!r}"
        for key in dict.fromkeys([*now, *before])
        if before.get(key) != now.get(key)
    ]
