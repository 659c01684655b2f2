"""Condition channels per sample.

HunyuanVideo 1.5: [condition latents (C), mask (1)] per frame. Text-to-video: zeros and mask 0.
Image-to-video: the first frame's latent on frame 0 (zeros on the others) and mask 1 on frame 0, as
HunyuanVideo15ImageToVideoPipeline.prepare_cond_latents_and_mask.

Wan 2.2 I2V-A14B: [mask (4), image-condition latent (C)] per latent frame, appended to the noisy
latent's channels (WanImageToVideoPipeline.prepare_latents without ``expand_timesteps``). The
image-condition latent is the VAE's normalised latent of the clip [first frame, zero frames ...]
(all its latent frames: the causal VAE's later ones depend on the first frame too, so it is
encoded once at preparation, not rebuilt from the first frame); the mask is 1 on latent frame 0 (the
4 pixel frames it covers: the given image), 0 on the others.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dfm.data.patchify import patchify


def first_frame_condition(first_frame: Tensor, num_frames: int) -> Tensor:
    """first-frame latent [C, 1, H, W] -> image-to-video condition [C + 1, T, H, W]."""
    c, _, h, w = first_frame.shape
    condition = first_frame.new_zeros(c + 1, num_frames, h, w)
    condition[:c, 0] = first_frame[:, 0]
    condition[c, 0] = 1.0
    return condition


WAN_MASK_CHANNELS = 4  # one per pixel frame of a latent frame (the Wan VAE's temporal compression)


def wan_condition_channels(model_cfg) -> int:
    """The per-patch-position channels a Wan patch embedding reads after the latent's (0: none)."""
    return WAN_MASK_CHANNELS + model_cfg.in_channels if model_cfg.wan_image_condition else 0


def wan_image_condition(image_latent: Tensor, patch_temporal: int, patch_spatial: int) -> Tensor:
    """image-condition latent [C, T, H, W] -> the condition tokens [L, pt*ph*pw*(4 + C)] of
    cat(mask, latent) (features (pt, ph, pw, c), as the latent's tokens)."""
    mask = image_latent.new_zeros(WAN_MASK_CHANNELS, *image_latent.shape[1:])
    mask[:, 0] = 1.0
    return patchify(torch.cat([mask, image_latent]), patch_temporal, patch_spatial)[0]


def condition_of(latent: Tensor, image_to_video: bool) -> Tensor:
    """latent [C, T, H, W] -> its condition [C + 1, T, H, W] (zeros for text-to-video)."""
    if image_to_video:
        return first_frame_condition(latent[:, :1], latent.shape[1])
    return latent.new_zeros(latent.shape[0] + 1, *latent.shape[1:])


def text_to_video_samples(batch, seed: int, iteration: int, i2v_prob: float) -> torch.Tensor:
    """[N] bool: the samples of ``batch`` that train text-to-video this iteration (each a function of
    (seed, iteration, global sample index), so of no parallel layout)."""
    import zlib

    chosen = []
    for index in batch.sample_index.tolist():
        generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{iteration}:{index}:i2v".encode()))
        chosen.append(bool(torch.rand(1, generator=generator) >= i2v_prob))
    return torch.tensor(chosen, dtype=torch.bool)


def as_text_to_video(batch, text_to_video: Tensor) -> dict:
    """The condition and image-embedding fields of ``batch`` (host) with the ``text_to_video`` [N] samples'
    zeroed (diffusers treats an all-zero image embedding as none)."""
    token_t2v = text_to_video[batch.token_sample_ids()]
    condition = torch.where(token_t2v[:, None], torch.zeros_like(batch.condition), batch.condition)
    images = torch.where(text_to_video[:, None, None], torch.zeros_like(batch.image_embeds), batch.image_embeds)
    return dict(condition=condition, image_embeds=images)
