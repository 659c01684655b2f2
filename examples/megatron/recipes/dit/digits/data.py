"""scikit-learn's 8x8 handwritten digits (1797 images) as a captioned image folder, prepared into
energon shards by the real preparation path, with a tiny random T5 and the identity VAE.

    t5_dir = build_digit_text_encoder(root / "t5")
    dataset_dir = prepare_digits_dataset(root, t5_dir)    # energon dataset of 8x8x1 latents

Pixels are 0..16 in scikit-learn; they are written as 8-bit PNGs (v * 255 / 16, exact for integers)
and read back by the preparation as [-1, 1]. The identity VAE (grey, no compression) then shifts and
scales them to mean 0 and std 0.5, EDM's sigma_data convention (in [-1, 1] the digits have mean
-0.39 and std 0.75).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

from dfm.data.encoders.identity_vae import write_identity_vae
from dfm.data.encoders.tiny import build_tiny_t5
from dfm.data.prepare.pipeline import PrepareReport, PrepareSettings, prepare_dataset

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
DIGIT_SIZE = 8  # pixels per side
DIGIT_MAX = 16.0  # scikit-learn's pixel range is 0..16
DIGIT_LATENT_STD = 0.5  # EDM's sigma_data
DIGIT_TEXT_DIM = 32  # width of the tiny T5; the model's text_embed_dim
DIGIT_MAX_TEXT_LEN = 32  # ByT5 bytes: "a handwritten digit seven" is 25 + EOS


def digit_caption(digit: int) -> str:
    return f"a handwritten digit {DIGIT_WORDS[digit]}"


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """-> (images [N, 8, 8] float in 0..16, labels [N] int), N = 1797."""
    from sklearn.datasets import load_digits as sklearn_digits

    data = sklearn_digits()
    return data.images.astype(np.float64), data.target.astype(np.int64)


def to_uint8(images: np.ndarray) -> np.ndarray:
    """0..16 -> 0..255 (exact for scikit-learn's integer pixels)."""
    return np.round(np.clip(images, 0, DIGIT_MAX) * 255 / DIGIT_MAX).astype(np.uint8)


def video_to_digit_pixels(video: np.ndarray) -> np.ndarray:
    """Decoded pixels in [-1, 1], any shape [N, ...] -> [N, ...] in 0..16 (the classifier's scale)."""
    return np.clip((np.asarray(video, dtype=np.float64) + 1) / 2, 0, 1) * DIGIT_MAX


def write_digit_vae(out_dir: str | Path, pixels: np.ndarray | None = None) -> Path:
    """Identity VAE (1 grey channel) normalising ``pixels`` (any shape, 0..16; default: the 8x8
    digits) to mean 0, std ``DIGIT_LATENT_STD``."""
    pixels = load_digits()[0] if pixels is None else pixels
    pixels = np.asarray(pixels) / DIGIT_MAX * 2 - 1  # [-1, 1], as the preparation reads the media
    return write_identity_vae(out_dir, 1, float(pixels.mean()), DIGIT_LATENT_STD / float(pixels.std()))


def write_digit_folder(raw_dir: str | Path, limit: int | None = None) -> int:
    """Write ``digit_NNNN.png`` (8x8 grey) and one ``captions.jsonl``; -> number of images."""
    raw_dir = Path(raw_dir)
    raw_dir.mkdir(parents=True, exist_ok=True)
    images, labels = load_digits()
    images, labels = images[:limit], labels[:limit]
    lines = []
    for index, (image, label) in enumerate(zip(to_uint8(images), labels)):
        name = f"digit_{index:04d}.png"
        Image.fromarray(image, mode="L").save(raw_dir / name)
        lines.append(json.dumps({"file": name, "caption": digit_caption(int(label))}))
    (raw_dir / "captions.jsonl").write_text("\n".join(lines) + "\n")
    return len(lines)


def build_digit_text_encoder(out_dir: str | Path, seed: int = 0) -> Path:
    """Tiny random T5 (ByT5 bytes, no download): distinct captions give distinct embeddings,
    which is all cross-attention needs to tell the digits apart."""
    return build_tiny_t5(Path(out_dir), seed, DIGIT_TEXT_DIM)


def digit_prepare_settings(root: Path, t5_dir: Path, vae_dir: Path, patch_spatial: int) -> PrepareSettings:
    """What ``prepare_energon_dataset.py --input_dir ROOT/raw --output_dir ROOT/dataset --height 8
    --width 8 --num_frames 1 --t5 T5_DIR --vae VAE_DIR --vae_subfolder '' --max_text_len 32
    --caption_format jsonl --run_energon_prepare`` builds (clips replace the size, frames and captions)."""
    return PrepareSettings(
        input_dir=str(root / "raw"),
        output_dir=str(root / "dataset"),
        caption_format="jsonl",
        height=DIGIT_SIZE,
        width=DIGIT_SIZE,
        num_frames=1,
        patch_spatial=patch_spatial,
        t5_name_or_dir=str(t5_dir),
        max_text_len=DIGIT_MAX_TEXT_LEN,
        vae_name_or_dir=str(vae_dir),
        vae_subfolder=None,
        shard_maxcount=500,
        run_energon_prepare=True,
        overwrite=True,  # a half-prepared folder from an interrupted run is redone
    )


def prepare_digits_dataset(
    root: str | Path, t5_dir: str | Path, vae_dir: str | Path, patch_spatial: int = 2, limit: int | None = None
) -> tuple[Path, PrepareReport]:
    """Raw folder under ``root/raw`` -> energon dataset under ``root/dataset``."""
    root = Path(root)
    write_digit_folder(root / "raw", limit)
    report = prepare_dataset(digit_prepare_settings(root, Path(t5_dir), Path(vae_dir), patch_spatial))
    return root / "dataset", report
