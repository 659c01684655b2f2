"""Finding and reading local media: images (Pillow) and videos (imageio-ffmpeg)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import imageio.v2 as imageio
import numpy as np
from PIL import Image

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp"})
VIDEO_EXTENSIONS = frozenset({".mp4", ".avi", ".mov", ".mkv", ".webm"})


@dataclass
class MediaItem:
    path: Path
    frames: np.ndarray  # [T, H, W, 3] uint8; images have T=1
    fps: float | None  # None for images; frames per second after the stride
    source_frames: int  # frames in the source file (1 for images; -1 if the container does not say)

    @property
    def is_video(self) -> bool:
        return self.path.suffix.lower() in VIDEO_EXTENSIONS

    @property
    def height(self) -> int:
        return int(self.frames.shape[1])

    @property
    def width(self) -> int:
        return int(self.frames.shape[2])


def is_media_file(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() in IMAGE_EXTENSIONS | VIDEO_EXTENSIONS


def find_media_files(input_dir: str | Path) -> list[Path]:
    """All images and videos under ``input_dir`` (recursive), sorted for a stable order; none is an error."""
    input_dir = Path(input_dir)
    if not input_dir.is_dir():
        raise FileNotFoundError(f"input_dir {input_dir} is not a directory")
    files = sorted(p for p in input_dir.rglob("*") if is_media_file(p))
    if not files:
        accepted = " ".join(sorted(IMAGE_EXTENSIONS | VIDEO_EXTENSIONS))
        raise FileNotFoundError(f"input_dir {input_dir} holds no media files (searched recursively for: {accepted})")
    return files


def read_image(path: Path) -> MediaItem:
    with Image.open(path) as image:
        frames = np.asarray(image.convert("RGB"))[None]
    return MediaItem(path=path, frames=frames, fps=None, source_frames=1)


def usable_frame_count(available: int, wanted: int, temporal_compression: int) -> int:
    """Largest n <= min(available, wanted) with (n - 1) divisible by the VAE's temporal factor."""
    n = min(available, wanted)
    return n - (n - 1) % temporal_compression if n >= 1 else 0


def read_video(path: Path, num_frames: int, frame_stride: int, temporal_compression: int) -> MediaItem:
    """Up to ``num_frames`` frames taken every ``frame_stride``; the count is cut to 1 + k * temporal_compression."""
    with imageio.get_reader(path, format="ffmpeg") as reader:
        meta = reader.get_meta_data()
        frames = []
        for i, frame in enumerate(reader):
            if i % frame_stride == 0:
                frames.append(np.asarray(frame)[..., :3])
                if len(frames) == num_frames:
                    break
    count = usable_frame_count(len(frames), num_frames, temporal_compression)
    if count == 0:
        raise ValueError(f"{path}: no decodable frames")
    fps = meta.get("fps")
    source_frames = meta.get("nframes")
    return MediaItem(
        path=path,
        frames=np.stack(frames[:count]),
        fps=float(fps) / frame_stride if fps else None,
        source_frames=int(source_frames)
        if isinstance(source_frames, (int, float)) and np.isfinite(source_frames)
        else -1,
    )


def read_media(path: Path, num_frames: int, frame_stride: int, temporal_compression: int) -> MediaItem:
    if path.suffix.lower() in IMAGE_EXTENSIONS:
        return read_image(path)
    return read_video(path, num_frames, frame_stride, temporal_compression)
