"""End to end on real shards: raw media -> preparation -> energon prepare -> training (and exact resume)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

RECIPE_DIR = Path(__file__).resolve().parents[2] / "examples" / "megatron" / "recipes" / "dit"


@pytest.fixture
def dataset(example_dataset):
    """The session's example dataset (tests/data/conftest.py)."""
    return example_dataset


def train(dataset_dir: Path, log_dir: Path, overrides: list[str]) -> dict[int, float]:
    cmd = [
        sys.executable, str(RECIPE_DIR / "pretrain_dit_model.py"), "--config-file", "conf/dit_tiny.yaml",
        f"dataset.path={dataset_dir}", "dataset.num_workers=0", "dataset.seq_length=512",
        f"logger.log_dir={log_dir}", *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, cwd=RECIPE_DIR, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r["loss"] for r in records}


def test_tiny_dit_trains_on_prepared_energon_data(dataset, tmp_path):
    assert dataset.corrupt_files and dataset.report.skipped  # the corrupt file is counted, not trained on
    losses = train(dataset.dataset_dir, tmp_path / "logs", ["train.train_iters=5"])
    assert sorted(losses) == [1, 2, 3, 4, 5]


def test_exact_resume_on_energon_data(dataset, tmp_path):
    save = tmp_path / "ckpt"
    straight = train(dataset.dataset_dir, tmp_path / "a", ["train.train_iters=10", f"checkpoint.save={save}", "checkpoint.save_interval=5"])
    resumed = train(dataset.dataset_dir, tmp_path / "b", ["train.train_iters=10", f"checkpoint.load={save}/iter_0000005"])
    assert sorted(resumed) == [6, 7, 8, 9, 10]
    assert all(resumed[i] == straight[i] for i in resumed), (straight, resumed)  # bitwise on CPU
