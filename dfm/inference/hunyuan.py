"""HunyuanVideo 1.5 generation: text-to-video and image-to-video packs from the pipeline's encoders,
sampled with the config's flow pipeline (Euler on the shifted sigmas, classifier-free guidance
against the negative prompt, as HunyuanVideo15(ImageToVideo)Pipeline)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dfm.data.encoders.hunyuan import HunyuanEncoders
from dfm.data.packed_batch import PackedBatch
from dfm.data.packing import pack_samples
from dfm.data.patchify import patchify
from dfm.data.sample import DiffusionSample
from dfm.data.video_condition import first_frame_condition
from dfm.diffusion.pipeline import SamplingOptions
from dfm.diffusion.registry import pipeline_from_config
from dfm.inference.sampling import sample_latent


def hunyuan_pack(encoders: HunyuanEncoders, prompt: str, noise: torch.Tensor, image=None) -> PackedBatch:
    """noise [C, T, H, W] + prompt (+ first-frame PIL image: image-to-video) -> a one-sample pack."""
    c, t, h, w = noise.shape
    qwen, byt5 = encoders.encode_text(prompt)
    if image is None:
        condition, image_embeds = (
            noise.new_zeros(c + 1, t, h, w),
            noise.new_zeros(1, encoders.siglip.config.hidden_size),
        )
    else:
        scale = encoders.vae.spatial_compression_ratio
        first_frame, image_embeds = encoders.encode_first_frame(image, h * scale, w * scale)
        condition = first_frame_condition(first_frame, t)
    tokens, pos_ids = patchify(noise, 1, 1)
    sample = DiffusionSample(
        tokens,
        pos_ids,
        qwen,
        tuple(noise.shape),
        0,
        condition=patchify(condition, 1, 1)[0],
        text_2=byt5,
        image_embeds=image_embeds,
    )
    return pack_samples([sample])


@dataclass
class HunyuanRequest:
    """One generation: noise [C, T, H, W] (T latent frames), the prompt, and for image-to-video the first frame."""

    prompt: str
    noise: torch.Tensor
    steps: int
    guidance_scale: float
    image: Any = None  # PIL image: image-to-video; None: text-to-video
    negative_prompt: str = ""


def sample_hunyuan(model, cfg, encoders: HunyuanEncoders, request: HunyuanRequest) -> torch.Tensor:
    """The clean latent [C, T, H, W] of ``request``."""
    batch = hunyuan_pack(encoders, request.prompt, request.noise, request.image)
    uncond = None
    if request.guidance_scale != 1.0:
        uncond = hunyuan_pack(encoders, request.negative_prompt, request.noise, request.image)
    options = SamplingOptions(request.steps, request.guidance_scale, "euler")
    return sample_latent(model, pipeline_from_config(cfg), batch, cfg.model, options, uncond)
