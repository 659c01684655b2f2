"""Validation samples people look at, through the real entry point: ``validation.prompts`` generated at
``train.eval_interval``, decoded by the VAE (tiny random encoders here), written under
``<log_dir>/validation/iter_<N>/``, and the same pixels in TensorBoard and in a W&B offline run."""

from __future__ import annotations

import json
from types import SimpleNamespace

import imageio.v2 as imageio
import numpy as np
import pytest
import torch
from entry import run_entry
from test_experiment_loggers import wandb_offline_history

from dfm.config.errors import ConfigError
from dfm.config.loader import build_config
from dfm.data.prepare.shards import AtomicShardWriter, encode_sample_parts, prepared_encoders
from dfm.training.plot import main as plot_main
from dfm.training.plot import read_curves
from dfm.training.sample_metrics import measure
from dfm.training.validation_media import latent_shape, slug

PROMPTS = ["a red cat", "two dogs/../on a beach"]


# Sizes per prompt: one run makes an image (1 x 32 x 32 pixels) and a video (5 frames of 32 x 32: 2
# latent frames of the tiny Wan VAE, an mp4).
SIZES = [[1, 32, 32], [5, 32, 32]]
KINDS = ["image", "video"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("validation_media")
    log_dir, tb_dir = tmp / "logs", tmp / "tb"
    overrides = [
        f"validation.sizes={json.dumps(SIZES)}",
        "train.train_iters=2",
        "train.eval_interval=2",
        "train.eval_iters=1",
        "train.eval_noise_bins=2",
        f"validation.prompts={json.dumps(PROMPTS)}",
        "validation.tiny_random_encoders=true",
        "validation.metrics=[pixel_stats]",
        "validation.steps=2",
        f"logger.log_dir={log_dir}",
        f"logger.tensorboard_dir={tb_dir}",
        "logger.wandb_project=dfm-test",
        "logger.wandb_exp_name=media",
    ]
    result = run_entry(1, overrides, env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert result.returncode == 0, result.stderr[-4000:]
    return log_dir, tb_dir


def read_frames(path) -> np.ndarray:
    """[T, H, W, 3] uint8 of a written png or mp4."""
    return np.stack(list(imageio.mimread(path))) if path.suffix == ".mp4" else imageio.imread(path)[None]


def written_files(log_dir) -> list:
    return sorted((log_dir / "validation" / "iter_0000002").glob("*.*"))


@pytest.mark.slow
def test_each_prompt_is_written_decoded_and_recorded(run):
    log_dir, _ = run
    files = written_files(log_dir)
    assert [f.suffix for f in files] == [".png", ".mp4"]
    assert [f.stem for f in files] == [f"{k:02d}_{slug(p)}" for k, p in enumerate(PROMPTS)]
    assert "/" not in files[1].name and files[1].parent == files[0].parent  # the prompt never makes a path
    for path, (num_frames, height, width) in zip(files, SIZES):
        frames = read_frames(path)
        assert frames.shape == (num_frames, height, width, 3) and frames.std() > 0  # decoded noise, not a blank
    (record,) = [json.loads(line) for line in (log_dir / "validation.jsonl").read_text().splitlines()]
    assert record["samples"] == [str(f) for f in files]
    pixels = np.concatenate([read_frames(f).ravel() for f in files]).astype(np.float64)
    # The files are lossless for the image only (mp4 is lossy): the metric saw the decoded pixels.
    assert record["pixel_stats/mean"] == pytest.approx(pixels.mean(), abs=2.0)
    assert record["pixel_stats/diversity"] == 0.0  # the two samples differ in size: no pair to compare


@pytest.mark.slow
def test_tensorboard_and_wandb_hold_the_samples(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir, tb_dir = run
    events = EventAccumulator(str(tb_dir), size_guidance={"images": 0})
    events.Reload()
    for k in range(len(PROMPTS)):
        (image,) = events.Images(f"validation/sample_{k}")
        assert image.step == 2 and image.width > 0 and image.height > 0
    for k, prompt in enumerate(PROMPTS):  # W&B flattens a media item into <key>/<field> history entries
        assert wandb_offline_history(log_dir, f"validation/sample_{k}/caption") == {2: prompt}
        assert wandb_offline_history(log_dir, f"validation/sample_{k}/_type") == {2: f"{KINDS[k]}-file"}
    (run_dir,) = log_dir.glob("wandb/offline-run-*")
    media = [p for p in (run_dir / "files" / "media").rglob("*") if p.is_file()]
    assert len(media) == len(PROMPTS), media


def test_prepared_datasets_record_their_encoders(tmp_path):
    """The default encoders come from the dataset's first sample; other folders record none."""
    meta = {"caption": "c", "t5_encoder": "/enc/t5", "vae": "/enc/vae", "vae_kind": "identity"}
    with AtomicShardWriter(tmp_path, "rank000", maxcount=4) as writer:
        writer.write({**encode_sample_parts("k0", torch.zeros(4, 1, 2, 2), torch.zeros(3, 8), meta), "__key__": "k0"})
    assert prepared_encoders(tmp_path) == {"t5": "/enc/t5", "vae": "/enc/vae", "vae_kind": "identity"}
    assert prepared_encoders(tmp_path / "missing") is None


@pytest.mark.slow
def test_plot_draws_the_runs_curves(run, tmp_path):
    """python -m dfm.training.plot on the run's log folder: the curves it plots are the logged numbers."""
    log_dir, _ = run
    curves = read_curves(log_dir)
    (record,) = [json.loads(line) for line in (log_dir / "validation.jsonl").read_text().splitlines()]
    assert curves.loss[0] == [1, 2] and curves.val_loss == ([2], [record["val_loss"]])
    assert {k: (level, values) for k, (level, _, values) in curves.levels.items()} == {
        k: (record["val_levels"][k], [record[f"val_loss_t{k}"]]) for k in range(2)
    }
    assert curves.metrics["pixel_stats/std"] == ([2], [record["pixel_stats/std"]])
    out = plot_main([str(log_dir), "--out", str(tmp_path / "curves.png")])
    image = imageio.imread(out)
    assert image.shape[:2] == (400, 1500) and image.std() > 0  # 3 panels (losses, per level, metrics), 5 x 4 in


class _WanLikeVAE:
    """What latent_shape_for reads of a VAE: 8x spatial, 4x temporal compression (Wan's)."""

    spatial_compression, temporal_compression = 8, 4

    def valid_num_frames(self, frames: int) -> bool:
        return frames % 4 == 1

    def latent_frames(self, frames: int) -> int:
        return 1 + (frames - 1) // 4


def test_sizes_per_prompt_the_last_repeats_and_none_take_the_validation_samples():
    cfg = build_config("dit_tiny", None)
    encoders = SimpleNamespace(vae=_WanLikeVAE())
    assert latent_shape(cfg, encoders, 3, (4, 1, 8, 8)) == (4, 1, 8, 8)
    cfg.validation.sizes = [[1, 32, 32], [9, 64, 32]]
    shapes = [latent_shape(cfg, encoders, k, (4, 1, 8, 8)) for k in range(3)]
    assert shapes == [(4, 1, 4, 4), (4, 3, 8, 4), (4, 3, 8, 4)]
    with pytest.raises(ConfigError, match=r"validation.sizes\[0\]"):
        build_config("dit_tiny", None, ["validation.sizes=[[1,32]]"])


def test_pixel_stats_diversity_is_zero_for_copies_and_unknown_metrics_are_named():
    frames = np.random.default_rng(0).integers(0, 255, (1, 4, 4, 3), dtype=np.uint8)
    same = [SimpleNamespace(frames=frames), SimpleNamespace(frames=frames.copy())]
    other = [SimpleNamespace(frames=frames), SimpleNamespace(frames=255 - frames)]
    assert measure(["pixel_stats"], same)["pixel_stats/diversity"] == 0.0
    assert measure(["pixel_stats"], other)["pixel_stats/diversity"] > 0.5
    with pytest.raises(ValueError, match=r"\['fid'\], not registered"):
        measure(["fid"], same)
