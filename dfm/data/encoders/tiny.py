"""Tiny, randomly initialised T5, CLIP and VAEs, built and saved locally (tests and smoke runs; no download).

Each saved folder holds a ``tiny_random_encoders.json`` marker, so data preparation can record
``tiny_random_encoders: true`` in the shard metadata and nobody mistakes the latents for real ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import AutoencoderKL, AutoencoderKLWan
from transformers import ByT5Tokenizer, CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel
from transformers.convert_slow_tokenizer import bytes_to_unicode

MARKER_FILE = "tiny_random_encoders.json"


@dataclass
class TinyEncoderPaths:
    t5_dir: Path
    wan_vae_dir: Path  # video + image VAE (AutoencoderKLWan): spatial 8x, temporal 4x
    kl_vae_dir: Path  # image VAE (AutoencoderKL): spatial 8x
    flux_vae_dir: Path  # the same with FLUX.1's shift_factor and scaling_factor
    clip_dir: Path  # CLIPTextModel + CLIPTokenizer (pooled text vector)


# FLUX.1's AutoencoderKL latent normalisation (its vae/config.json): latents = (z - shift) * scale.
FLUX_VAE_SHIFT_FACTOR, FLUX_VAE_SCALING_FACTOR = 0.1159, 0.3611
CLIP_MAX_LENGTH = 77


def is_tiny_random(folder: str | Path) -> bool:
    return (Path(folder) / MARKER_FILE).is_file()


def _mark(folder: Path, what: str, seed: int) -> None:
    (folder / MARKER_FILE).write_text(json.dumps({"tiny_random_encoders": True, "model": what, "seed": seed}))


def _save_tiny(out_dir: Path, seed: int, what: str, build, tokenizer=None) -> Path:
    """``build()`` (a model) under ``seed``, saved with ``tokenizer`` to ``out_dir`` and marked as ``what``."""
    torch.manual_seed(seed)
    build().save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    _mark(out_dir, what, seed)
    return out_dir


def build_tiny_t5(out_dir: Path, seed: int, text_dim: int) -> Path:
    tokenizer = ByT5Tokenizer()  # byte-level: needs no vocabulary file
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=text_dim,
        d_kv=8,
        d_ff=2 * text_dim,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        dropout_rate=0.0,
    )
    return _save_tiny(out_dir, seed, "T5EncoderModel", lambda: T5EncoderModel(config), tokenizer)


def build_tiny_wan_vae(out_dir: Path, seed: int, latent_channels: int, **wan22) -> Path:
    """AutoencoderKLWan, Wan 2.1's kind (``wan22``: the Wan 2.2 VAE's extra config, build_tiny_wan22_vae)."""
    config = dict(
        base_dim=8,
        z_dim=latent_channels,
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * latent_channels,
        latents_std=[1.0] * latent_channels,
        **wan22,
    )
    what = "AutoencoderKLWan" + (" (Wan 2.2)" if wan22 else "")
    return _save_tiny(out_dir, seed, what, lambda: AutoencoderKLWan(**config))


def build_tiny_wan22_vae(out_dir: Path, seed: int, latent_channels: int = 48) -> Path:
    """The Wan 2.2 VAE's kind (residual blocks, 2x2 pixel patches: 16x spatial, 4x temporal; z_dim 48
    as Wan2.2-TI2V-5B's), tiny."""
    wan22 = dict(is_residual=True, in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16)
    return build_tiny_wan_vae(out_dir, seed, latent_channels, **wan22)


def tiny_clip_tokenizer() -> CLIPTokenizer:
    """CLIP's byte-level BPE over a vocabulary of the 256 byte symbols (and their end-of-word forms),
    no merges: every character is a token. Built here, nothing downloaded."""
    symbols = list(bytes_to_unicode().values())
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    vocab.update({s: len(vocab) + i for i, s in enumerate(symbols)})
    vocab.update({s + "</w>": len(vocab) + i for i, s in enumerate(symbols)})
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=CLIP_MAX_LENGTH)


def build_tiny_clip(out_dir: Path, seed: int, pooled_dim: int) -> Path:
    """A CLIPTextModel whose pooler_output is ``pooled_dim`` wide, with its tokenizer."""
    tokenizer = tiny_clip_tokenizer()
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=pooled_dim,
        intermediate_size=2 * pooled_dim,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=CLIP_MAX_LENGTH,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return _save_tiny(out_dir, seed, "CLIPTextModel", lambda: CLIPTextModel(config), tokenizer)


def build_tiny_kl_vae(out_dir: Path, seed: int, latent_channels: int, **normalisation) -> Path:
    """``normalisation``: AutoencoderKL's shift_factor / scaling_factor (default: SD's)."""
    config = dict(
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        block_out_channels=[8, 8, 16, 16],
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=64,
        **normalisation,
    )
    return _save_tiny(out_dir, seed, "AutoencoderKL", lambda: AutoencoderKL(**config))


def tiny_encoder_paths(out_dir: str | Path) -> TinyEncoderPaths:
    """Where ``build_tiny_random_encoders`` saves each encoder under ``out_dir``."""
    out_dir = Path(out_dir)
    return TinyEncoderPaths(
        t5_dir=out_dir / "t5",
        wan_vae_dir=out_dir / "vae_wan",
        kl_vae_dir=out_dir / "vae_kl",
        flux_vae_dir=out_dir / "vae_flux",
        clip_dir=out_dir / "clip",
    )


def build_tiny_random_encoders(
    out_dir: str | Path, seed: int = 0, text_dim: int = 32, latent_channels: int = 4, pooled_dim: int = 16
) -> TinyEncoderPaths:
    """Build and save a tiny T5 (ByT5 tokenizer), CLIP, and Wan, KL and FLUX VAEs under ``out_dir``."""
    paths = tiny_encoder_paths(out_dir)
    build_tiny_t5(paths.t5_dir, seed, text_dim)
    build_tiny_wan_vae(paths.wan_vae_dir, seed, latent_channels)
    build_tiny_kl_vae(paths.kl_vae_dir, seed, latent_channels)
    flux_factors = dict(shift_factor=FLUX_VAE_SHIFT_FACTOR, scaling_factor=FLUX_VAE_SCALING_FACTOR)
    build_tiny_kl_vae(paths.flux_vae_dir, seed, latent_channels, **flux_factors)
    build_tiny_clip(paths.clip_dir, seed, pooled_dim)
    return paths
