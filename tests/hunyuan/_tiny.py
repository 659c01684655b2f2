"""A tiny random diffusers HunyuanVideo 1.5 transformer and its dfm config and weights."""

from __future__ import annotations

import diffusers
import torch

from dfm.convert.cli import import_config
from dfm.convert.hunyuan import HUNYUAN, hunyuan_rules
from dfm.convert.rules import to_dfm

TINY = dict(
    in_channels=9,  # 4 latent channels, 4 condition channels, 1 mask
    out_channels=4,
    num_attention_heads=2,
    attention_head_dim=16,
    num_layers=2,
    num_refiner_layers=2,
    text_embed_dim=24,
    text_embed_2_dim=20,
    image_embed_dim=12,
    rope_axes_dim=(4, 6, 6),
)


def tiny_diffusers_hunyuan(seed: int = 0, std: float = 0.1) -> diffusers.HunyuanVideo15Transformer3DModel:
    """Random weights everywhere (norm weights around 1 would hide a swapped scale; draw them too)."""
    torch.manual_seed(seed)
    model = diffusers.HunyuanVideo15Transformer3DModel(**TINY).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            param.copy_(
                torch.randn(param.shape, generator=generator) * std + (1.0 if param.dim() == 1 and "norm" in _ else 0.0)
            )
    return model


def dfm_config_and_weights(reference):
    """(validated ConfigContainer, {global name: tensor}) of ``reference`` as the import makes them."""
    cfg = import_config(HUNYUAN, dict(reference.config), None, ["model.attention_backend=sdpa"])
    return cfg, to_dfm(reference.state_dict(), hunyuan_rules(cfg.model))
