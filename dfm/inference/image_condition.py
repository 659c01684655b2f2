"""Image-to-video from ``--image``. Wan 2.2 TI2V (diffusers' ``expand_timesteps``): the image's VAE
latent is the clean first latent frame, kept at every sampling step (dfm/diffusion/first_frame.py).
Wan 2.2 I2V-A14B (``model.wan_image_condition``): the VAE latent of [image, zero frames ...] is the
image condition the model reads beside the noisy latent (dfm/data/video_condition.py)."""

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


def image_condition_latent(vae, path: str | Path, height: int, width: int, num_frames: int) -> torch.Tensor:
    """The normalised latent [C, T', H', W'] of the image followed by ``num_frames - 1`` zero frames
    (WanImageToVideoPipeline's ``latent_condition``, the VAE's mode)."""
    image = read_image(path, height, width)
    zeros = image.new_zeros(*image.shape[:2], num_frames - 1, *image.shape[3:])
    return vae.encode(torch.cat([image, zeros], dim=2))[0].float().cpu()


def image_inputs(vae, model_cfg, args) -> dict:
    """generation_batch's image keywords for ``args.image`` (height, width, num_video_frames): TI2V's
    ``first_frame`` or I2V's ``image_condition``; {} without an image."""
    image = getattr(args, "image", None)
    if model_cfg.wan_image_condition:
        if image is None:
            raise ValueError("model.wan_image_condition (Wan 2.2 I2V) generates from an image: pass --image")
        return {"image_condition": image_condition_latent(vae, image, args.height, args.width, args.num_video_frames)}
    return {} if image is None else {"first_frame": image_latent(vae, image, args.height, args.width)}
