"""The frozen encoders generation needs: T5 for the prompt, a VAE to decode latents.

Either pretrained ones (hub names or local folders) or tiny random ones built to the
checkpoint's shapes (tests, smoke runs: the output is noise, but every step runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dfm.data.encoders import T5TextEncoder, VideoVAE, build_tiny_random_encoders


@dataclass
class EncoderSources:
    t5: str
    t5_cache_dir: str | None = None
    vae: str = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    vae_subfolder: str | None = "vae"
    vae_kind: str = "auto"
    vae_cache_dir: str | None = None


@dataclass
class Encoders:
    text: T5TextEncoder
    vae: VideoVAE


def load_encoders(sources: EncoderSources, max_text_len: int, device: torch.device) -> Encoders:
    text = T5TextEncoder.from_pretrained_or_cache(sources.t5, sources.t5_cache_dir, max_text_len, device)
    vae = VideoVAE.from_pretrained_or_cache(
        sources.vae, sources.vae_cache_dir, kind=sources.vae_kind, subfolder=sources.vae_subfolder, device=device
    )
    return Encoders(text, vae)


def tiny_random_encoders(
    model_cfg, out_dir: str | Path, max_text_len: int, device: torch.device, seed: int = 0
) -> Encoders:
    """Tiny random T5 (width text_embed_dim) and Wan VAE (in_channels latents), saved under ``out_dir``."""
    paths = build_tiny_random_encoders(
        out_dir, seed, text_dim=model_cfg.text_embed_dim, latent_channels=model_cfg.in_channels
    )
    sources = EncoderSources(t5=str(paths.t5_dir), vae=str(paths.wan_vae_dir), vae_subfolder=None)
    return load_encoders(sources, max_text_len, device)


def check_encoders_match(encoders: Encoders, model_cfg) -> None:
    """Fail early, naming both sizes, when the encoders do not fit the trained model."""
    if encoders.text.embed_dim != model_cfg.text_embed_dim:
        raise ValueError(
            f"T5 {encoders.text.name} embeds to {encoders.text.embed_dim} but the model was trained with "
            f"model.text_embed_dim={model_cfg.text_embed_dim}"
        )
    if encoders.vae.latent_channels != model_cfg.in_channels:
        raise ValueError(
            f"VAE {encoders.vae.name} has {encoders.vae.latent_channels} latent channels but the model was "
            f"trained with model.in_channels={model_cfg.in_channels}"
        )
