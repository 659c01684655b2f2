"""The packed batch a generation runs on: one sample whose latents are the starting noise.

Same contract as training (dfm/data/packed_batch.py), so the model sees nothing new:
latents [S, pt*ph*pw*C] patchified noise, context [L, D_text] the prompt's T5 embedding.
"""

from __future__ import annotations

import dataclasses

import torch

from dfm.data.packed_batch import PackedBatch
from dfm.data.packing import pack_samples
from dfm.data.patchify import check_patchable, patchify
from dfm.data.sample import DiffusionSample
from dfm.data.video_condition import wan_image_condition


def latent_shape_for(vae, model_cfg, height: int, width: int, num_frames: int) -> tuple[int, int, int, int]:
    """(C, T', H', W') of the latent that decodes to ``num_frames`` x ``height`` x ``width`` pixels."""
    step = vae.spatial_compression * model_cfg.patch_spatial
    if height % step or width % step:
        raise ValueError(
            f"--height {height} and --width {width} must be multiples of {step} "
            f"(VAE spatial compression {vae.spatial_compression} x patch size {model_cfg.patch_spatial})"
        )
    if not vae.valid_num_frames(num_frames):
        raise ValueError(f"--num_video_frames must be 1 + {vae.temporal_compression}k for this VAE, got {num_frames}")
    shape = (
        model_cfg.in_channels,
        vae.latent_frames(num_frames),
        height // vae.spatial_compression,
        width // vae.spatial_compression,
    )
    check_patchable(shape, model_cfg.patch_temporal, model_cfg.patch_spatial)
    return shape


def draw_noise(latent_shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Standard-normal latent [C, T', H', W'] from a CPU generator: the same seed gives the same noise on any device."""
    return torch.randn(latent_shape, generator=torch.Generator().manual_seed(seed))


def generation_batch(
    noise: torch.Tensor,
    text: torch.Tensor,
    model_cfg,
    first_frame: torch.Tensor | None = None,
    image_condition: torch.Tensor | None = None,
    multiples: tuple[int, int] = (1, 1),
) -> PackedBatch:
    """noise [C, T', H', W'], text [L, D_text] -> a one-sample PackedBatch (latents = patchified noise).
    ``first_frame`` [C, 1, H', W']: an image's latent, the clean first frame of image-to-video (Wan 2.2
    TI2V); the sampler keeps it at every step (dfm/diffusion/first_frame.py). ``image_condition``
    [C, T', H', W']: Wan 2.2 I2V's image-condition latent (dfm/data/video_condition.py). ``multiples``:
    the layout's padding (``ParallelLayout.padding_multiples``), for sampling under SP or CP."""
    if image_condition is not None:
        if multiples != (1, 1):
            raise ValueError(f"image-conditioned generation runs unpadded, not with padding multiples {multiples}")
        batch = generation_pack([noise], [text], model_cfg)
        tokens = wan_image_condition(image_condition.to(noise.dtype), model_cfg.patch_temporal, model_cfg.patch_spatial)
        return dataclasses.replace(batch, image_condition=tokens)
    if first_frame is None:
        return generation_pack([noise], [text], model_cfg, multiples)
    start = torch.cat([first_frame.to(noise.dtype), noise[:, 1:]], dim=1)
    batch = generation_pack([start], [text], model_cfg, multiples)
    return dataclasses.replace(batch, first_frame_clean=torch.tensor([True]))


def generation_pack(
    noises: list[torch.Tensor], texts: list[torch.Tensor], model_cfg, multiples: tuple[int, int] = (1, 1)
) -> PackedBatch:
    """N samples in one pack (one model call per step for all): noises [C, T', H', W'] and texts [L, D_text];
    ``multiples`` (segment, total): the layout's padding, as training packs are padded."""
    samples = []
    for index, (noise, text) in enumerate(zip(noises, texts, strict=True)):
        tokens, pos_ids = patchify(noise, model_cfg.patch_temporal, model_cfg.patch_spatial)
        samples.append(
            DiffusionSample(
                tokens=tokens, pos_ids=pos_ids, text=text, latent_shape=tuple(noise.shape), sample_index=index
            )
        )
    return pack_samples(samples, *multiples)


def null_text_batch(batch: PackedBatch) -> PackedBatch:
    """The unconditional twin for classifier-free guidance: text zeroed, as cfg dropout does in training."""
    return dataclasses.replace(batch, context=torch.zeros_like(batch.context))
