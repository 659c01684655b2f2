"""A tiny random diffusers FLUX, saved as a folder, and its dfm config and weights."""

from __future__ import annotations

import diffusers
import torch

from dfm.convert.flux import FLUX, flux_rules
from dfm.convert.import_export import import_config
from dfm.convert.rules import to_dfm
from tests._parity import random_model

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
    return random_model(lambda: diffusers.FluxTransformer2DModel(**{**TINY, **overrides}), seed, std)


def dfm_config_and_weights(reference: diffusers.FluxTransformer2DModel):
    """(validated ConfigContainer, {global name: tensor}) of ``reference`` as the import makes them."""
    # Pinned: numerics are compared with diffusers on the CPU, whatever the host has.
    cfg = import_config(FLUX, dict(reference.config), None, ["model.attention_backend=sdpa"])
    return cfg, to_dfm(reference.state_dict(), flux_rules(cfg.model))


# Captioned images of three sizes; under --max_pixels 2048 they land in 32 x 64, 64 x 32 and 32 x 32 buckets.
TINY_IMAGES = (("wide", (32, 64), "a red stripe"), ("tall", (64, 32), "a blue tower"), ("square", (48, 48), "dots"))


def write_tiny_images(folder) -> None:
    """Random-pixel png images with sidecar captions, sizes of ``TINY_IMAGES``."""
    import json
    from pathlib import Path

    import imageio.v3 as iio

    folder = Path(folder)
    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    for name, (height, width), caption in TINY_IMAGES:
        pixels = (torch.rand(height, width, 3, generator=generator) * 255).to(torch.uint8).numpy()
        iio.imwrite(folder / f"{name}.png", pixels)
        (folder / f"{name}.json").write_text(json.dumps({"caption": caption}))


def prepare_with_flux_encoders(tmp_path, max_text_len: int):
    """Energon shards of ``write_tiny_images`` through prepare_energon_dataset.py with the tiny FLUX
    encoders (full-length T5, CLIP pooled vector, FLUX's VAE) and the real ``energon prepare``."""

    from tests.training.entry import prepare_shards

    write_tiny_images(tmp_path / "images")
    flags = ["--caption_format", "sidecar", "--max_pixels", 2048, "--max_text_len", max_text_len]
    return prepare_shards(
        tmp_path / "images", tmp_path / "shards", *flags, "--encoders", "flux", "--tiny_random_encoders"
    )
