"""Decoded pixels -> files: mp4 for videos (imageio-ffmpeg), an image (png, jpg) for one frame."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

VIDEO_SUFFIXES = (".mp4",)
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


def check_output_path(path: str | Path, num_frames: int) -> Path:
    """Reject a suffix that cannot hold the output before any work is done."""
    path = Path(path)
    valid = VIDEO_SUFFIXES if num_frames > 1 else IMAGE_SUFFIXES
    if path.suffix.lower() not in valid:
        kind = f"{num_frames} frames (a video)" if num_frames > 1 else "1 frame (an image)"
        raise ValueError(f"--video_save_path {path}: {kind} needs one of {', '.join(valid)}")
    return path


def to_uint8_frames(video: torch.Tensor) -> np.ndarray:
    """video [3, T, H, W] in [-1, 1] -> frames [T, H, W, 3] uint8."""
    pixels = ((video.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return pixels.permute(1, 2, 3, 0).cpu().numpy()


def write_media(frames: np.ndarray, path: str | Path, fps: int) -> Path:
    """frames [T, H, W, 3] uint8 -> ``path`` (mp4 when T > 1, else an image)."""
    import imageio.v2 as imageio

    path = check_output_path(path, frames.shape[0])
    path.parent.mkdir(parents=True, exist_ok=True)
    if frames.shape[0] > 1:
        # macro_block_size=1: keep the exact size (imageio would otherwise resize to multiples of 16).
        imageio.mimwrite(path, list(frames), fps=fps, codec="libx264", macro_block_size=1)
    else:
        imageio.imwrite(path, frames[0])
    return path
