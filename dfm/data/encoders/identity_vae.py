"""An identity "VAE": the latents are the pixels themselves (no compression, nothing learned).

For tiny images on CPU (the 8x8 digits of the learning test, docs/learning.md): a real VAE would
need a download and compresses 8x8 pixels to one latent pixel, and a tiny random VAE is not
invertible, so samples could not be judged in pixel space. Latents are pixels in [-1, 1], EDM's
convention for images (sigma_data = 0.5). ``identity`` keeps RGB (3 channels); ``identity_grey``
averages it to 1 channel (decoded back to 3 equal channels).

Use it by name wherever a VAE is named: ``--vae identity_grey`` (preparation, inference).
"""

from __future__ import annotations

import torch

IDENTITY_VAE_CHANNELS = {"identity": 3, "identity_grey": 1}


def is_identity_vae(name_or_dir) -> bool:
    return str(name_or_dir) in IDENTITY_VAE_CHANNELS


class IdentityVAE:
    """Same interface as ``VideoVAE``: video [B, 3, T, H, W] in [-1, 1] <-> latents [B, C, T, H, W]."""

    kind = "identity"
    spatial_compression = 1
    temporal_compression = 1

    def __init__(self, name: str = "identity") -> None:
        if not is_identity_vae(name):
            raise ValueError(f"unknown identity VAE {name!r}; valid: {', '.join(IDENTITY_VAE_CHANNELS)}")
        self.name = name
        self.latent_channels = IDENTITY_VAE_CHANNELS[name]

    def latent_frames(self, num_frames: int) -> int:
        return num_frames

    def valid_num_frames(self, num_frames: int) -> bool:
        return num_frames >= 1

    @torch.no_grad()
    def encode(self, video: torch.Tensor) -> torch.Tensor:
        """video [B, 3, T, H, W] -> latents [B, C, T, H, W] (C = 3, or 1 for grey)."""
        if video.dim() != 5 or video.shape[1] != 3:
            raise ValueError(f"expected video [B, 3, T, H, W], got {tuple(video.shape)}")
        video = video.float()
        return video.mean(dim=1, keepdim=True) if self.latent_channels == 1 else video

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """latents [B, C, T, H, W] -> video [B, 3, T, H, W] clamped to [-1, 1]."""
        video = latents.float().clamp(-1, 1)
        return video.expand(-1, 3, -1, -1, -1) if video.shape[1] == 1 else video
