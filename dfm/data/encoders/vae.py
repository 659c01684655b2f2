"""VAE wrapper: video [B, 3, T, H, W] in [-1, 1] <-> normalised latents [B, C, T', H', W'].

Two diffusers families:
- ``wan``: AutoencoderKLWan (Wan 2.1; Wan 2.2's, z_dim 48 and 2x2 pixel patches, is the same class:
  ``wan22`` loads it and checks it is), causal 3D; T frames -> 1 + (T - 1) / 4 latent frames, the
  first of them the first frame's alone. Latents normalised per channel with the config's
  latents_mean / latents_std.
- ``kl``: AutoencoderKL (image VAE), applied frame by frame (T' = T); latents scaled by
  scaling_factor after subtracting shift_factor.
Encoding uses the posterior mean, so a sample always gets the same latent.
The names ``identity`` / ``identity_grey`` (or an IdentityVAE folder) load an ``IdentityVAE`` instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch
from diffusers import AutoencoderKL, AutoencoderKLWan

from dfm.data.encoders.identity_vae import IdentityVAE, is_identity_vae

VaeKind = Literal["wan", "wan22", "kl"]
_CLASS_TO_KIND = {"AutoencoderKLWan": "wan", "AutoencoderKL": "kl"}


def detect_vae_kind(name_or_dir: str | Path, subfolder: str | None = None) -> VaeKind:
    """Read ``_class_name`` from a local VAE folder's config.json."""
    folder = Path(name_or_dir) / (subfolder or "")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"cannot detect the VAE kind: {config_file} not found; pass vae_kind='wan' or 'kl'")
    class_name = json.loads(config_file.read_text()).get("_class_name")
    if class_name not in _CLASS_TO_KIND:
        raise ValueError(f"{config_file}: unsupported VAE class {class_name!r} (supported: {list(_CLASS_TO_KIND)})")
    return _CLASS_TO_KIND[class_name]


class VideoVAE:
    def __init__(self, model: torch.nn.Module, kind: VaeKind, name: str) -> None:
        self.model = model.eval().requires_grad_(False)
        self.kind = kind
        self.name = name

    @classmethod
    def from_pretrained_or_cache(
        cls,
        name_or_dir: str | Path,
        cache_dir: str | Path | None = None,
        kind: VaeKind | Literal["auto"] = "auto",
        subfolder: str | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> VideoVAE | IdentityVAE:
        """Load a local folder or a hub name (e.g. ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers`` with subfolder ``vae``)."""
        for candidate in (name_or_dir, Path(name_or_dir) / (subfolder or "")):
            if is_identity_vae(candidate):
                return IdentityVAE.load(candidate)
        if kind == "auto":
            kind = detect_vae_kind(name_or_dir, subfolder)
        model_class = AutoencoderKLWan if kind in ("wan", "wan22") else AutoencoderKL
        model = model_class.from_pretrained(
            str(name_or_dir),
            subfolder=subfolder,
            cache_dir=None if cache_dir is None else str(cache_dir),
            torch_dtype=dtype,
        ).to(device)
        if kind == "wan22" and not model.config.patch_size:
            raise ValueError(
                f"--vae {name_or_dir}: vae_kind wan22 needs the Wan 2.2 VAE (patch_size set), not Wan 2.1's"
            )
        return cls(model, "wan" if kind == "wan22" else kind, name=str(name_or_dir))

    @property
    def latent_channels(self) -> int:
        config = self.model.config
        return int(config.z_dim if self.kind == "wan" else config.latent_channels)

    @property
    def spatial_compression(self) -> int:
        config = self.model.config
        if self.kind == "wan":  # Wan 2.2's VAE patchifies pixels 2x2 before its 8x
            return 2 ** len(config.temperal_downsample) * (config.patch_size or 1)
        return 2 ** (len(config.block_out_channels) - 1)

    @property
    def temporal_compression(self) -> int:
        return 2 ** sum(self.model.config.temperal_downsample) if self.kind == "wan" else 1

    def latent_frames(self, num_frames: int) -> int:
        return 1 + (num_frames - 1) // self.temporal_compression

    def valid_num_frames(self, num_frames: int) -> bool:
        return num_frames >= 1 and (num_frames - 1) % self.temporal_compression == 0

    def _param(self) -> torch.Tensor:
        return next(self.model.parameters())

    def _wan_stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, -1, 1, 1, 1)
        mean = torch.tensor(self.model.config.latents_mean, dtype=like.dtype, device=like.device).view(shape)
        std = torch.tensor(self.model.config.latents_std, dtype=like.dtype, device=like.device).view(shape)
        return mean, std

    @torch.no_grad()
    def encode(self, video: torch.Tensor) -> torch.Tensor:
        """video [B, 3, T, H, W] in [-1, 1] -> normalised latents [B, C, T', H', W']."""
        if video.dim() != 5 or video.shape[1] != 3:
            raise ValueError(f"expected video [B, 3, T, H, W], got {tuple(video.shape)}")
        if self.kind == "wan" and not self.valid_num_frames(video.shape[2]):
            raise ValueError(f"Wan VAE needs 1 + {self.temporal_compression}k frames, got {video.shape[2]}")
        video = video.to(self._param())
        if self.kind == "wan":
            latents = self.model.encode(video).latent_dist.mode()
            mean, std = self._wan_stats(latents)
            return (latents - mean) / std
        b, _, t, _, _ = video.shape
        frames = video.permute(0, 2, 1, 3, 4).flatten(0, 1)
        latents = self.model.encode(frames).latent_dist.mode()
        shift = self.model.config.shift_factor or 0.0
        latents = (latents - shift) * self.model.config.scaling_factor
        return latents.unflatten(0, (b, t)).permute(0, 2, 1, 3, 4)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """normalised latents [B, C, T', H', W'] -> video [B, 3, T, H, W] clamped to [-1, 1]."""
        latents = latents.to(self._param())
        if self.kind == "wan":
            mean, std = self._wan_stats(latents)
            return self.model.decode(latents * std + mean).sample.clamp(-1, 1)
        b, _, t, _, _ = latents.shape
        shift = self.model.config.shift_factor or 0.0
        frames = latents.permute(0, 2, 1, 3, 4).flatten(0, 1) / self.model.config.scaling_factor + shift
        video = self.model.decode(frames).sample.clamp(-1, 1)
        return video.unflatten(0, (b, t)).permute(0, 2, 1, 3, 4)
