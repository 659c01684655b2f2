"""A tiny random diffusers FLUX, saved as a folder, and its dfm config and weights."""

from __future__ import annotations

import diffusers
import torch

from dfm.convert.cli import import_config
from dfm.convert.flux import FLUX, flux_rules
from dfm.convert.rules import to_dfm

TINY = dict(
    patch_size=1,
    in_channels=16,  # 4 latent channels x 2 x 2
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=24,
    pooled_projection_dim=12,
    guidance_embeds=True,
    axes_dims_rope=(4, 6, 6),
)


def tiny_diffusers_flux(seed: int = 0, std: float = 0.1, **overrides) -> diffusers.FluxTransformer2DModel:
    """Random weights everywhere (diffusers zero-initialises nothing here, but make it explicit)."""
    torch.manual_seed(seed)
    model = diffusers.FluxTransformer2DModel(**{**TINY, **overrides}).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            param.copy_(torch.randn(param.shape, generator=generator) * std)
    return model


def dfm_config_and_weights(reference: diffusers.FluxTransformer2DModel):
    """(validated ConfigContainer, {global name: tensor}) of ``reference`` as the import makes them."""
    cfg = import_config(FLUX, dict(reference.config), None, [])
    return cfg, to_dfm(reference.state_dict(), flux_rules(cfg.model))
