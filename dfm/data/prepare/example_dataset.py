"""A small real dataset built on the fly (tests, smoke runs): real images, generated videos,
every caption format and one corrupt file, prepared with tiny random encoders and energon.

    dataset = build_example_dataset(tmp_path)   # dataset.dataset_dir is an energon dataset
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import imageio.v2 as imageio
import numpy as np
from PIL import Image

from dfm.data.prepare.pipeline import PrepareReport, PrepareSettings, prepare_dataset

EXAMPLE_MAX_PIXELS = 64 * 64  # tiny buckets keep CPU tests fast
EXAMPLE_NUM_FRAMES = 9  # -> 3 latent frames with the Wan VAE


@dataclass
class ExampleDataset:
    raw_dir: Path
    dataset_dir: Path  # prepared energon dataset (CrudeWebdataset)
    captions: dict[str, str]  # source path (relative to raw_dir) -> expected caption
    corrupt_files: list[str]  # relative paths expected to be skipped
    report: PrepareReport


def sample_photos() -> list[np.ndarray]:
    """scikit-learn's two bundled photos (china.jpg, flower.jpg) as uint8 [H, W, 3]."""
    from sklearn.datasets import load_sample_images

    return [np.asarray(image) for image in load_sample_images().images]


def write_video(path: Path, frames: np.ndarray, fps: int = 8) -> None:
    imageio.mimwrite(path, list(frames), fps=fps, codec="libx264", macro_block_size=16, quality=7)


def panning_frames(photo: np.ndarray, count: int, height: int, width: int, step: int) -> np.ndarray:
    return np.stack([photo[:height, i * step : i * step + width] for i in range(count)])


def moving_bars(count: int, height: int, width: int) -> np.ndarray:
    x = np.arange(width)[None, :]
    frames = [np.broadcast_to(((x + 4 * t) % 32 < 16) * 255, (height, width)) for t in range(count)]
    return np.stack([np.stack([f, f // 2, 255 - f], axis=-1) for f in frames]).astype(np.uint8)


def write_raw_folder(raw_dir: Path) -> tuple[dict[str, str], list[str]]:
    """Media with every caption format; returns (expected captions, corrupt files)."""
    raw_dir.mkdir(parents=True, exist_ok=True)
    china, flower = sample_photos()
    Image.fromarray(china).save(raw_dir / "china_palace.jpg")  # sidecar caption
    Image.fromarray(flower[:200, :300]).save(raw_dir / "flower_crop.png")  # jsonl caption
    Image.fromarray(flower[50:370, 200:380]).save(raw_dir / "tall_flower.webp")  # meta.json caption
    Image.fromarray(china[::4, ::5]).save(raw_dir / "small_china_view.bmp")  # file-name caption
    (raw_dir / "clips").mkdir(exist_ok=True)
    write_video(raw_dir / "clips" / "pan_over_palace.mp4", panning_frames(china, 12, 128, 192, 16))  # jsonl
    write_video(raw_dir / "moving_bars.mp4", moving_bars(10, 64, 96))  # sidecar
    write_video(raw_dir / "flower_zoom.mp4", panning_frames(flower, 9, 96, 96, 8))  # file name
    (raw_dir / "broken_photo.jpg").write_bytes(b"\xff\xd8\xff\xe0 this is not a jpeg" * 8)
    (raw_dir / "china_palace.json").write_text(json.dumps({"caption": "a red palace under a blue sky"}))
    (raw_dir / "moving_bars.json").write_text(json.dumps({"caption": "stripes sliding to the left"}))
    (raw_dir / "captions.jsonl").write_text(
        json.dumps({"file": "flower_crop.png", "caption": "close-up of a pink flower"})
        + "\n"
        + json.dumps({"file": "clips/pan_over_palace.mp4", "caption": "camera pans over a palace"})
        + "\n"
    )
    (raw_dir / "meta.json").write_text(json.dumps([{"file_name": "tall_flower.webp", "caption": "a tall flower"}]))
    captions = {
        "china_palace.jpg": "a red palace under a blue sky",
        "flower_crop.png": "close-up of a pink flower",
        "tall_flower.webp": "a tall flower",
        "small_china_view.bmp": "small china view",
        "clips/pan_over_palace.mp4": "camera pans over a palace",
        "moving_bars.mp4": "stripes sliding to the left",
        "flower_zoom.mp4": "flower zoom",
    }
    return captions, ["broken_photo.jpg"]


def build_example_dataset(root: str | Path, shard_maxcount: int = 3, run_energon: bool = True) -> ExampleDataset:
    """Raw folder under ``root/raw``, energon dataset under ``root/dataset`` (~20 s on 2 CPU cores)."""
    root = Path(root)
    captions, corrupt = write_raw_folder(root / "raw")
    settings = PrepareSettings(
        input_dir=str(root / "raw"),
        output_dir=str(root / "dataset"),
        max_pixels=EXAMPLE_MAX_PIXELS,
        num_frames=EXAMPLE_NUM_FRAMES,
        tiny_random_encoders=True,
        max_text_len=64,
        shard_maxcount=shard_maxcount,
        run_energon_prepare=run_energon,
        max_skip_fraction=0.2,  # one of its eight files is corrupt on purpose
    )
    report = prepare_dataset(settings)
    return ExampleDataset(root / "raw", root / "dataset", captions, corrupt, report)
