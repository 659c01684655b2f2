"""An identity "VAE": the latents are the pixels themselves (no compression, nothing learned).

For tiny images on CPU (the 8x8 digits of the learning test, docs/learning.md): a real VAE would
need a download and compresses 8x8 pixels to one latent pixel, and a tiny random VAE is not
invertible, so samples could not be judged in pixel space. Latents are pixels in [-1, 1], EDM's
convention for images (sigma_data = 0.5). ``identity`` keeps RGB (3 channels); ``identity_grey``
averages it to 1 channel (decoded back to 3 equal channels).

Use it by name wherever a VAE is named: ``--vae identity_grey`` (preparation, inference), or as a
folder whose ``config.json`` holds ``{"_class_name": "IdentityVAE", "latent_channels": 1,
"shift_factor": m, "scaling_factor": s}``: latents are then ``(pixels - m) * s``, e.g. to bring the
data to EDM's sigma_data = 0.5 (``write_identity_vae``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

IDENTITY_VAE_CHANNELS = {"identity": 3, "identity_grey": 1}
CLASS_NAME = "IdentityVAE"


def is_identity_vae(name_or_dir) -> bool:
    """A known name, or a folder whose config.json names the IdentityVAE class."""
    if str(name_or_dir) in IDENTITY_VAE_CHANNELS:
        return True
    config = Path(name_or_dir) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("_class_name") == CLASS_NAME


def write_identity_vae(folder: str | Path, latent_channels: int, shift_factor: float, scaling_factor: float) -> Path:
    """Save an identity VAE with a normalisation as a folder that ``--vae FOLDER --vae_subfolder ''`` loads."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "_class_name": CLASS_NAME,
        "latent_channels": latent_channels,
        "shift_factor": shift_factor,
        "scaling_factor": scaling_factor,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


class IdentityVAE:
    """Same interface as ``VideoVAE``: video [B, 3, T, H, W] in [-1, 1] <-> latents [B, C, T, H, W]."""

    kind = "identity"
    spatial_compression = 1
    temporal_compression = 1

    def __init__(
        self, name: str = "identity", latent_channels: int = 3, shift_factor: float = 0.0, scaling_factor: float = 1.0
    ):
        if latent_channels not in (1, 3):
            raise ValueError(f"an identity VAE has 1 (grey) or 3 (RGB) latent channels, got {latent_channels}")
        self.name, self.latent_channels = name, latent_channels
        self.shift_factor, self.scaling_factor = shift_factor, scaling_factor

    @classmethod
    def load(cls, name_or_dir: str | Path) -> IdentityVAE:
        """By name (``identity``, ``identity_grey``) or from a folder written by ``write_identity_vae``."""
        if str(name_or_dir) in IDENTITY_VAE_CHANNELS:
            return cls(str(name_or_dir), IDENTITY_VAE_CHANNELS[str(name_or_dir)])
        config = json.loads((Path(name_or_dir) / "config.json").read_text())
        return cls(str(name_or_dir), config["latent_channels"], config["shift_factor"], config["scaling_factor"])

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
        pixels = video.mean(dim=1, keepdim=True) if self.latent_channels == 1 else video
        return (pixels - self.shift_factor) * self.scaling_factor

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """latents [B, C, T, H, W] -> video [B, 3, T, H, W] clamped to [-1, 1]."""
        video = (latents.float() / self.scaling_factor + self.shift_factor).clamp(-1, 1)
        return video.expand(-1, 3, -1, -1, -1) if video.shape[1] == 1 else video
