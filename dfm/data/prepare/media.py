"""Finding and reading local media: images (Pillow) and videos (imageio-ffmpeg's ffmpeg binary)."""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
from PIL import Image

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp"})
VIDEO_EXTENSIONS = frozenset({".mp4", ".avi", ".mov", ".mkv", ".webm"})


@dataclass
class MediaItem:
    path: Path
    frames: np.ndarray  # [T, H, W, 3] uint8; images have T=1
    fps: float | None  # None for images; frames per second after the stride
    source_frames: int  # frames in the source file: 1 for images, -1 for videos (counting them means decoding all)

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


def ffmpeg_fps(log: str) -> float:
    """The first video stream's frame rate in ffmpeg's log ("Stream #0:0...: Video: ..., 8 fps, ..."), read as
    imageio reads it; 0 when that line gives none."""
    line = next((line for line in log.splitlines() if line.lstrip().startswith("Stream ") and " Video: " in line), "")
    match = re.search(r" ([0-9]+\.?[0-9]*) fps", line)
    return float(match[1]) if match else 0.0


def ppm_frames(stream: BinaryIO) -> Iterator[np.ndarray]:
    """Frames [H, W, 3] uint8 of ffmpeg's ``-c:v ppm -f image2pipe`` output, each "P6\\n<W> <H>\\n255\\n" + pixels."""
    while stream.readline() == b"P6\n":
        width, height = map(int, stream.readline().split())
        stream.readline()  # the maximum value: 255 for rgb24
        pixels = stream.read(width * height * 3)
        if len(pixels) < width * height * 3:
            return  # cut short: ffmpeg failed, its log says why
        yield np.frombuffer(pixels, np.uint8).reshape(height, width, 3)


def read_video(path: Path, num_frames: int, frame_stride: int, temporal_compression: int) -> MediaItem:
    """Frames [T, H, W, 3] uint8 RGB: up to ``num_frames`` taken every ``frame_stride``, T cut to 1 + k *
    temporal_compression; ``fps`` is the file's divided by the stride. One ffmpeg run, started directly
    (imageio's reader forks this whole process first, which costs more CPU than decoding a short clip)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    decoded = (num_frames - 1) * frame_stride + 1  # the frames ffmpeg decodes, the last one kept
    from imageio_ffmpeg import get_ffmpeg_exe  # a 68 MB binary wheel: only decoding videos needs it

    command = [get_ffmpeg_exe(), "-nostdin", "-hide_banner", "-nostats", "-i", str(path), "-frames:v", str(decoded)]
    command += ["-pix_fmt", "rgb24", "-c:v", "ppm", "-f", "image2pipe", "-"]
    with tempfile.TemporaryFile() as log:  # a file, not a pipe: a long log cannot stall ffmpeg
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log) as ffmpeg:
            frames = [frame for i, frame in enumerate(ppm_frames(ffmpeg.stdout)) if i % frame_stride == 0]
        log.seek(0)
        text = log.read().decode(errors="replace").strip()
    count = usable_frame_count(len(frames), num_frames, temporal_compression)
    if count == 0:
        reason = text.splitlines()[-1] if text else f"ffmpeg exit status {ffmpeg.returncode}"
        raise ValueError(f"{path}: no decodable frames ({reason})")
    fps = ffmpeg_fps(text)
    return MediaItem(
        path=path, frames=np.stack(frames[:count]), fps=fps / frame_stride if fps else None, source_frames=-1
    )


def read_media(path: Path, num_frames: int, frame_stride: int, temporal_compression: int) -> MediaItem:
    if path.suffix.lower() in IMAGE_EXTENSIONS:
        return read_image(path)
    return read_video(path, num_frames, frame_stride, temporal_compression)
