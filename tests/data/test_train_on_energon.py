"""End to end: raw media -> preparation -> energon prepare -> 5 training iterations of the tiny DiT."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dfm.data.prepare.example_dataset import build_example_dataset

RECIPE_DIR = Path(__file__).resolve().parents[2] / "examples" / "megatron" / "recipes" / "dit"


def test_tiny_dit_trains_on_prepared_energon_data(tmp_path):
    dataset = build_example_dataset(tmp_path / "example")
    assert dataset.corrupt_files and dataset.report.skipped  # the corrupt file is counted, not trained on
    log_dir = tmp_path / "logs"
    cmd = [
        sys.executable, str(RECIPE_DIR / "pretrain_dit_model.py"), "--config-file", "conf/dit_tiny.yaml",
        f"dataset.path={dataset.dataset_dir}", "dataset.num_workers=0", "dataset.seq_length=512",
        "train.train_iters=5", f"logger.log_dir={log_dir}",
    ]
    result = subprocess.run(cmd, cwd=RECIPE_DIR, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3, 4, 5]
    assert all(r["tokens_per_sec_per_gpu"] > 0 for r in records)
