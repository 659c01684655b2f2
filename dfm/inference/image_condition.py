"""Image-to-video from ``--image`` (Wan 2.2 TI2V, diffusers' ``expand_timesteps``): the image's VAE
latent is the clean first latent frame, kept at every sampling step (dfm/diffusion/first_frame.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image


def read_image(path: str | Path, height: int, width: int) -> torch.Tensor:
    """An image file -> [1, 3, 1, height, width] in [-1, 1], resized (Lanczos) as diffusers' VideoProcessor does."""
    with Image.open(path) as image:
        image = image.convert("RGB")
        if image.size != (width, height):
            image = image.resize((width, height), Image.LANCZOS)
        pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0)
    return (2 * pixels - 1).permute(2, 0, 1)[None, :, None]


def image_latent(vae, path: str | Path, height: int, width: int) -> torch.Tensor:
    """The image's normalised latent [C, 1, H', W'] (the VAE's mode, as WanImageToVideoPipeline encodes it)."""
    return vae.encode(read_image(path, height, width))[0].float().cpu()
