"""The frozen encoders generation needs: T5 for the prompt (and CLIP's pooled vector for FLUX), a VAE
to decode latents.

Either pretrained ones (hub names or local folders) or tiny random ones built to the
checkpoint's shapes (tests, smoke runs: the output is noise, but every step runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dfm.data.encoders import (
    CLIPPooledEncoder,
    T5TextEncoder,
    VideoVAE,
    build_tiny_random_encoders,
    tiny_encoder_paths,
)


@dataclass
class EncoderSources:
    t5: str
    t5_cache_dir: str | None = None
    vae: str = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    vae_subfolder: str | None = "vae"
    vae_kind: str = "auto"
    vae_cache_dir: str | None = None
    # FLUX: CLIP text encoder folder or FLUX.1 pipeline folder. Set: CLIP's pooled prompt vector, and T5
    # at full length (FluxPipeline's convention); None: T5 unpadded, no pooled vector.
    clip: str | None = None


NEEDS_CLIP = "a FLUX model needs CLIP's pooled prompt vector: pass --clip (a CLIP folder or the FLUX.1 folder)"


@dataclass
class Encoders:
    text: T5TextEncoder
    vae: VideoVAE
    pooled: CLIPPooledEncoder | None = None  # FLUX's pooled prompt vector


def uses_pooled_text(model_cfg) -> bool:
    """FLUX: T5 at full length (FluxPipeline's convention) plus CLIP's pooled vector."""
    return model_cfg.pooled_text_dim is not None


def load_encoders(sources: EncoderSources, max_text_len: int, device: torch.device) -> Encoders:
    flux = sources.clip is not None
    text = T5TextEncoder.from_pretrained_or_cache(
        sources.t5, sources.t5_cache_dir, max_text_len, device, full_length=flux
    )
    vae = VideoVAE.from_pretrained_or_cache(
        sources.vae, sources.vae_cache_dir, kind=sources.vae_kind, subfolder=sources.vae_subfolder, device=device
    )
    pooled = CLIPPooledEncoder.from_pretrained(sources.clip, device=device) if flux else None
    return Encoders(text, vae, pooled)


def tiny_random_encoders(
    model_cfg, out_dir: str | Path, max_text_len: int, device: torch.device, seed: int = 0, build: bool = True
) -> Encoders:
    """Tiny random T5 (width text_embed_dim), VAE (in_channels latents; FLUX's for FLUX, else Wan's)
    and, for FLUX, CLIP (width pooled_text_dim), saved under ``out_dir`` (``build=False``: loaded from there,
    as another process saved them)."""
    flux = uses_pooled_text(model_cfg)
    if build:
        paths = build_tiny_random_encoders(
            out_dir,
            seed,
            text_dim=model_cfg.text_embed_dim,
            latent_channels=model_cfg.in_channels,
            pooled_dim=model_cfg.pooled_text_dim or 16,
        )
    else:
        paths = tiny_encoder_paths(out_dir)
    sources = EncoderSources(
        t5=str(paths.t5_dir),
        vae=str(paths.flux_vae_dir if flux else paths.wan_vae_dir),
        vae_subfolder=None,
        clip=str(paths.clip_dir) if flux else None,
    )
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
    if uses_pooled_text(model_cfg) and encoders.pooled is None:
        raise ValueError(NEEDS_CLIP)
    if encoders.pooled is not None and encoders.pooled.embed_dim != model_cfg.pooled_text_dim:
        raise ValueError(
            f"CLIP {encoders.pooled.name} pools to {encoders.pooled.embed_dim} but the model was trained with "
            f"model.pooled_text_dim={model_cfg.pooled_text_dim}"
        )
