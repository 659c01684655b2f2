"""Validation samples people look at: ``validation.prompts`` generated at ``train.eval_interval``, decoded
by the VAE and written as one png (an image) or mp4 (a video) per prompt under
``<logger.log_dir>/validation/iter_<N>/``; the MetricsLog sends the same pixels to TensorBoard and W&B.

Every rank of the model-parallel group runs the sampler (TP ranks hold shards of each layer); every DP
replica draws the same samples from the same seeds, and the logging rank writes them. Generation needs
the whole model in one group: no pipeline or context split (the loss per noise level runs everywhere).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dfm.config.container import ConfigContainer
from dfm.data.prepare.shards import prepared_encoders
from dfm.diffusion.pipeline import DiffusionPipeline, SamplingOptions
from dfm.inference.encoders import (
    Encoders,
    EncoderSources,
    check_encoders_match,
    load_encoders,
    tiny_random_encoders,
)
from dfm.inference.generate import prompt_batch
from dfm.inference.generation_batch import draw_noise, latent_shape_for
from dfm.inference.media import to_uint8_frames, write_media
from dfm.inference.student import sample_as_trained

logger = logging.getLogger("dfm.validation")


@dataclass
class DecodedSample:
    prompt: str
    frames: np.ndarray  # [T, H, W, 3] uint8
    path: Path | None  # where it was written (the logging rank only)


def encoder_sources(cfg: ConfigContainer) -> EncoderSources:
    """``validation.t5`` / ``validation.vae``, each defaulting to what the dataset's samples record."""
    v = cfg.validation
    recorded = prepared_encoders(cfg.dataset.path) if cfg.dataset.path and (v.t5 is None or v.vae is None) else None
    if (v.t5 is None or v.vae is None) and recorded is None:
        raise ValueError(
            f"validation.prompts need a text encoder and a VAE: set validation.t5 and validation.vae "
            f"(dataset.path={cfg.dataset.path!r} records none: not a folder prepared by dfm)"
        )
    t5 = v.t5 if v.t5 is not None else recorded["t5"]
    vae, kind = (v.vae, v.vae_kind) if v.vae is not None else (recorded["vae"], recorded["vae_kind"])
    return EncoderSources(t5=t5, vae=vae, vae_subfolder=None, vae_kind=kind)


def validation_encoders(cfg: ConfigContainer, device: torch.device) -> Encoders:
    """The text encoder and VAE of ``validation`` (tiny random ones under the log folder if asked)."""
    if cfg.validation.tiny_random_encoders:
        # Rank 0 saves them (transformers saves a model from the main process only), the others load its files.
        folder = Path(cfg.logger.log_dir) / "validation" / ".tiny_random_encoders"
        distributed = torch.distributed.is_initialized()
        first = not distributed or torch.distributed.get_rank() == 0
        if first:
            encoders = tiny_random_encoders(cfg.model, folder, cfg.model.max_text_len, device, cfg.validation.seed)
        if distributed:
            torch.distributed.barrier()
        if not first:
            encoders = tiny_random_encoders(cfg.model, folder, cfg.model.max_text_len, device, build=False)
    else:
        encoders = load_encoders(encoder_sources(cfg), cfg.model.max_text_len, device)
    check_encoders_match(encoders, cfg.model)
    return encoders


def latent_shape(cfg: ConfigContainer, encoders: Encoders, k: int, default: tuple[int, ...]) -> tuple[int, ...]:
    """(C, T, H, W) of prompt ``k``: its ``validation.sizes`` entry (the last one repeats) through the VAE,
    or ``default`` (the first validation sample's latent shape) without sizes."""
    sizes = cfg.validation.sizes
    if not sizes:
        return tuple(default)
    frames, height, width = sizes[min(k, len(sizes) - 1)]
    return latent_shape_for(encoders.vae, cfg.model, height, width, frames)


def generate_samples(
    cfg: ConfigContainer,
    model,
    pipeline: DiffusionPipeline,
    encoders: Encoders,
    device: torch.device,
    default_shape: tuple[int, ...],
    multiples: tuple[int, int] = (1, 1),
) -> list[DecodedSample]:
    """Each of ``validation.prompts`` sampled from the noise of ``validation.seed + k`` and decoded;
    ``model``: ``sampling_model``'s, ``multiples``: the layout's padding."""
    v = cfg.validation
    options = SamplingOptions(v.steps or cfg.train.eval_sampling_steps, v.guidance_scale, seed=v.seed)
    samples = []
    for k, prompt in enumerate(v.prompts):
        noise = draw_noise(latent_shape(cfg, encoders, k, default_shape), v.seed + k)
        batch = prompt_batch(prompt, noise, encoders, cfg.model, {}, multiples).to(device)  # FLUX: + pooled text
        latent = sample_as_trained(model, pipeline, batch, cfg, options, v.seed + k)
        video = encoders.vae.decode(latent.unsqueeze(0).to(device))[0]  # [3, T, H, W] in [-1, 1]
        samples.append(DecodedSample(prompt, to_uint8_frames(video), None))
    return samples


def write_samples(samples: list[DecodedSample], log_dir: str | Path, iteration: int, fps: int) -> list[DecodedSample]:
    """``<log_dir>/validation/iter_<N>/<k>_<prompt words>.png|mp4`` for each sample -> the samples with paths."""
    folder = Path(log_dir) / "validation" / f"iter_{iteration:07d}"
    written = []
    for k, sample in enumerate(samples):
        suffix = ".mp4" if sample.frames.shape[0] > 1 else ".png"
        path = write_media(sample.frames, folder / f"{k:02d}_{slug(sample.prompt)}{suffix}", fps)
        written.append(dataclasses.replace(sample, path=path))
    return written


def slug(prompt: str, limit: int = 40) -> str:
    """A file-name-safe prefix of ``prompt``: words joined by '_' (never a path separator)."""
    return re.sub(r"[^A-Za-z0-9]+", "_", prompt).strip("_")[:limit] or "prompt"
