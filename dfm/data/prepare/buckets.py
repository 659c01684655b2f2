"""Resolution buckets: fit media into a pixel budget, keeping aspect ratio and size multiples.

A bucket's height and width are multiples of ``patch_spatial * vae_spatial_compression`` so the
latent patchifies exactly. Media is resized to cover the bucket and centre-cropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

RESOLUTION_PRESETS = {"256p": 256 * 256, "512p": 512 * 512, "768p": 768 * 768, "1024p": 1024 * 1024}


@dataclass
class ResolutionPolicy:
    multiple: int  # patch_spatial * VAE spatial compression
    max_pixels: int | None = None  # pixel budget (aspect ratio kept)
    height: int | None = None  # or a fixed size
    width: int | None = None

    def __post_init__(self) -> None:
        fixed = self.height is not None or self.width is not None
        if fixed == (self.max_pixels is not None):
            raise ValueError("give either max_pixels (or a preset) or both height and width")
        if fixed:
            if self.height is None or self.width is None:
                raise ValueError("a fixed size needs both height and width")
            for name, size in (("height", self.height), ("width", self.width)):
                if size % self.multiple != 0:
                    raise ValueError(f"{name}={size} is not a multiple of patch*VAE factor {self.multiple}")
        elif self.max_pixels < self.multiple**2:
            raise ValueError(f"max_pixels={self.max_pixels} is below one {self.multiple}x{self.multiple} block")

    @classmethod
    def from_args(
        cls,
        multiple: int,
        preset: str | None = None,
        max_pixels: int | None = None,
        height: int | None = None,
        width: int | None = None,
    ) -> ResolutionPolicy:
        if preset is not None:
            if preset not in RESOLUTION_PRESETS:
                raise ValueError(f"unknown resolution preset {preset!r}; choose from {sorted(RESOLUTION_PRESETS)}")
            max_pixels = RESOLUTION_PRESETS[preset]
        return cls(multiple=multiple, max_pixels=max_pixels, height=height, width=width)

    def bucket(self, height: int, width: int) -> tuple[int, int]:
        """(bucket height, bucket width) for media of the given size."""
        if self.height is not None and self.width is not None:
            return self.height, self.width
        return budget_bucket(height, width, self.max_pixels, self.multiple)


def budget_bucket(height: int, width: int, max_pixels: int, multiple: int) -> tuple[int, int]:
    """Scale to about ``max_pixels`` keeping the aspect ratio, rounded down to multiples (area <= budget)."""
    scale = math.sqrt(max_pixels / (height * width))
    h = max(multiple, int(height * scale) // multiple * multiple)
    w = max(multiple, int(width * scale) // multiple * multiple)
    while h * w > max_pixels and max(h, w) > multiple:
        if h >= w:
            h -= multiple
        else:
            w -= multiple
    return h, w


def resize_center_crop(frames: np.ndarray, height: int, width: int) -> torch.Tensor:
    """uint8 frames [T, H, W, 3] -> float video [3, T, height, width] in [-1, 1]."""
    video = torch.as_tensor(np.array(frames, copy=True)).permute(0, 3, 1, 2).float()
    src_h, src_w = video.shape[-2:]
    scale = max(height / src_h, width / src_w)
    new_h, new_w = max(height, round(src_h * scale)), max(width, round(src_w * scale))
    video = F.interpolate(video, size=(new_h, new_w), mode="bilinear", antialias=True, align_corners=False)
    top, left = (new_h - height) // 2, (new_w - width) // 2
    video = video[..., top : top + height, left : left + width]
    return (video / 127.5 - 1.0).clamp(-1, 1).permute(1, 0, 2, 3)
