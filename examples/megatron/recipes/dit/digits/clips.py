"""Moving digits: scikit-learn's 8x8 digits sliding across a larger canvas, one captioned .mp4 per clip.

    write_clip_folder(root / "raw", ClipSpec())   # clip_NNNN.mp4 + clip_NNNN.json {"caption": ...}

Each clip shows one real digit for ``frames`` frames, moving ``speed`` pixels per frame in one of four
directions or standing still, and is captioned with both: "a handwritten seven moving left". Each path
is centred on the canvas (``random_start=False``, the default) or starts anywhere the digit stays whole.

The clips are H.264 at ``-qp 0`` (lossless in YUV): grey frames come back within 1/255 of what was
written, so the 17 grey levels of the digits survive exactly once scaled back to 0..16.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from imageio_ffmpeg import get_ffmpeg_exe

from dfm.data.prepare.pipeline import PrepareReport, prepare_dataset
from digits.data import DIGIT_SIZE, DIGIT_WORDS, digit_prepare_settings, load_digits, to_uint8, write_digit_vae

# (rows, columns) per frame; image rows grow downwards, so "up" is -1.
MOTIONS = {
    "moving left": (0, -1),
    "moving right": (0, 1),
    "moving up": (-1, 0),
    "moving down": (1, 0),
    "standing still": (0, 0),
}
MOTION_NAMES = tuple(MOTIONS)
CLIP_MAX_TEXT_LEN = 40  # ByT5 bytes: "a handwritten seven standing still" is 34 + EOS
LOSSLESS_H264 = ["-c:v", "libx264", "-qp", "0", "-pix_fmt", "yuv420p"]  # ffmpeg output options


@dataclass(frozen=True)
class ClipSpec:
    canvas: int = 16  # pixels per side
    frames: int = 4
    speed: int = 2  # pixels per frame
    fps: int = 8
    seed: int = 0  # draws each clip's motion and start position
    # False: every path is centred on the canvas, so the caption fixes the trajectory and only the digit's
    # handwriting varies (what the CI run learns in minutes); True: starts anywhere the digit stays whole.
    random_start: bool = False

    def __post_init__(self) -> None:
        if self.travel > self.canvas - DIGIT_SIZE:
            raise ValueError(
                f"a digit moving {self.speed} px for {self.frames} frames travels {self.travel} px, more than "
                f"the {self.canvas - DIGIT_SIZE} px a {self.canvas}x{self.canvas} canvas leaves: "
                "raise canvas or lower frames / speed"
            )

    @property
    def travel(self) -> int:
        """Pixels a moving digit covers from the first frame to the last."""
        return self.speed * (self.frames - 1)


def clip_caption(digit: int, motion: str) -> str:
    return f"a handwritten {DIGIT_WORDS[digit]} {motion}"


def all_captions() -> list[tuple[int, str]]:
    """Every (digit, motion) a caption can name, digit-major: 10 x 5."""
    return [(digit, motion) for digit in range(len(DIGIT_WORDS)) for motion in MOTION_NAMES]


def draw_start(rng: np.random.Generator, step: int, spec: ClipSpec) -> int:
    """A start coordinate from which ``frames`` steps of ``step`` pixels stay on the canvas (the middle
    one unless ``spec.random_start``)."""
    room = spec.canvas - DIGIT_SIZE
    low, high = (spec.travel, room) if step < 0 else (0, room - spec.travel if step > 0 else room)
    return int(rng.integers(low, high + 1)) if spec.random_start else (low + high) // 2


def moving_digit_clip(image: np.ndarray, motion: str, start: tuple[int, int], spec: ClipSpec) -> np.ndarray:
    """image [8, 8] -> clip [T, canvas, canvas] (same dtype), the digit's corner at ``start`` in frame 0."""
    (dy, dx), (y0, x0) = MOTIONS[motion], start
    clip = np.zeros((spec.frames, spec.canvas, spec.canvas), dtype=image.dtype)
    for t in range(spec.frames):
        y, x = y0 + dy * spec.speed * t, x0 + dx * spec.speed * t
        clip[t, y : y + DIGIT_SIZE, x : x + DIGIT_SIZE] = image
    return clip


def moving_digit_clips(spec: ClipSpec, limit: int | None = None) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """-> (clips [N, T, canvas, canvas] in 0..16, digits [N], motions [N]): the i-th real digit, a
    motion drawn uniformly."""
    images, labels = load_digits()
    images, labels = images[:limit], labels[:limit]
    rng = np.random.default_rng(spec.seed)
    motions = [MOTION_NAMES[i] for i in rng.integers(0, len(MOTION_NAMES), len(images))]
    clips = []
    for image, motion in zip(images, motions):
        dy, dx = MOTIONS[motion]
        start = (draw_start(rng, dy, spec), draw_start(rng, dx, spec))
        clips.append(moving_digit_clip(image, motion, start, spec))
    return np.stack(clips), labels, motions


def write_clips(raw_dir: Path, clips: np.ndarray, fps: int) -> None:
    """clips [N, T, H, W] uint8 -> ``raw_dir/clip_NNNN.mp4``, one lossless H.264 .mp4 per clip, all from one
    ffmpeg run: a key frame starts each clip and the segment muxer cuts there (a run per clip costs ~30 ms of
    CPU, nearly all of it ffmpeg starting)."""
    _, frames, height, width = clips.shape
    cuts = ",".join(str(frames * i) for i in range(1, len(clips) + 1))
    command = [get_ffmpeg_exe(), "-y", "-v", "error", "-f", "rawvideo", "-pix_fmt", "gray"]
    command += ["-s", f"{width}x{height}", "-r", str(fps), "-i", "-", *LOSSLESS_H264]
    command += ["-force_key_frames", f"expr:eq(mod(n,{frames}),0)", "-f", "segment", "-segment_format", "mp4"]
    command += ["-segment_frames", cuts, "-reset_timestamps", "1", str(raw_dir / "clip_%04d.mp4")]
    subprocess.run(command, input=clips.tobytes(), check=True)


def write_clip_folder(raw_dir: str | Path, spec: ClipSpec, limit: int | None = None) -> int:
    """Write ``clip_NNNN.mp4`` with a ``clip_NNNN.json`` caption sidecar each; -> number of clips."""
    raw_dir = Path(raw_dir)
    raw_dir.mkdir(parents=True, exist_ok=True)
    clips, labels, motions = moving_digit_clips(spec, limit)
    write_clips(raw_dir, to_uint8(clips), spec.fps)
    for index, (digit, motion) in enumerate(zip(labels, motions)):
        (raw_dir / f"clip_{index:04d}.json").write_text(json.dumps({"caption": clip_caption(int(digit), motion)}))
    return len(clips)


def write_clip_vae(out_dir: str | Path, spec: ClipSpec) -> Path:
    """The identity VAE normalising these clips (mostly background) to mean 0, std 0.5."""
    return write_digit_vae(out_dir, moving_digit_clips(spec)[0])


def prepare_clips_dataset(
    root: str | Path,
    t5_dir: str | Path,
    vae_dir: str | Path,
    spec: ClipSpec,
    patch_spatial: int = 2,
    limit: int | None = None,
) -> tuple[Path, PrepareReport]:
    """Clip folder under ``root/raw`` -> energon dataset of [1, T, canvas, canvas] latents under ``root/dataset``."""
    root = Path(root)
    write_clip_folder(root / "raw", spec, limit)
    settings = replace(
        digit_prepare_settings(root, Path(t5_dir), Path(vae_dir), patch_spatial),
        height=spec.canvas,
        width=spec.canvas,
        num_frames=spec.frames,
        caption_format="sidecar",
        max_text_len=CLIP_MAX_TEXT_LEN,
    )
    return root / "dataset", prepare_dataset(settings)
