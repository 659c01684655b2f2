"""Bad data and bad settings through the real entry point (one process, the tiny model):
a sample with the wrong channel count stops the run naming its shard and key, or is skipped and
counted with dataset.skip_bad_samples; settings that used to lose work are refused before start."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import webdataset as wds
from entry import read_metrics, run_entry

from dfm.data.prepare.energon_prepare import run_energon_prepare

CHANNELS, TEXT_WIDTH = 4, 32  # conf/dit_tiny.yaml


@pytest.fixture(scope="module")
def dataset_with_a_bad_sample(tmp_path_factory) -> Path:
    """Real shards + `energon prepare`: 24 good 8x8 latents and one with a channel too many."""
    out = tmp_path_factory.mktemp("bad-data")
    gen = torch.Generator().manual_seed(0)

    def sample(key: str, channels: int) -> dict:
        latent = torch.randn(channels, 1, 8, 8, generator=gen)
        return {"__key__": key, "pth": latent, "pickle": torch.randn(6, TEXT_WIDTH, generator=gen), "json": {}}

    with wds.ShardWriter(str(out / "part-%06d.tar"), maxcount=100, verbose=0) as writer:
        for i in range(24):
            writer.write(sample(f"good{i:02d}", CHANNELS))
            if i == 3:
                writer.write(sample("wide-latent", CHANNELS + 1))
    run_energon_prepare(out)
    return out


def train_on(tmp: Path, dataset: Path, *overrides: str):
    args = ["train.train_iters=3", f"dataset.path={dataset}", f"logger.log_dir={tmp / 'logs'}", *overrides]
    return run_entry(1, args, mock=False)


@pytest.mark.slow
def test_a_bad_sample_stops_the_run_naming_shard_and_key(tmp_path, dataset_with_a_bad_sample):
    result = train_on(tmp_path, dataset_with_a_bad_sample)
    assert result.returncode != 0
    assert "part-000000.tar, key wide-latent" in result.stderr and "expected model.in_channels=4" in result.stderr


@pytest.mark.slow
def test_with_skip_bad_samples_it_is_skipped_counted_and_training_goes_on(tmp_path, dataset_with_a_bad_sample):
    result = train_on(tmp_path, dataset_with_a_bad_sample, "dataset.skip_bad_samples=true")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "key wide-latent" in result.stderr
    records = [r for r in read_metrics(tmp_path / "logs") if "loss" in r]
    assert [r["iteration"] for r in records] == [1, 2, 3] and records[-1]["skipped_bad_samples"] >= 1


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.global_batch_size=-1", "train.global_batch_size"),
        ("checkpoint.keep_last=-1", "checkpoint.keep_last"),
        ("checkpoint.save_interval=-1", "checkpoint.save_interval"),
    ],
)
def test_settings_that_lost_work_are_refused_before_start(tmp_path, override, key):
    result = run_entry(1, ["train.train_iters=3", f"logger.log_dir={tmp_path / 'logs'}", override])
    assert result.returncode == 2 and key in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "logs" / "metrics.jsonl").exists()
