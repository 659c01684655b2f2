"""Run ``energon prepare`` on a folder of shards (index + dataset.yaml for a CrudeWebdataset)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def energon_prepare_command(dataset_dir: str | Path, split_ratio: str = "1,0,0", num_workers: int = 1) -> list[str]:
    """The exact command line; same as ``energon prepare DIR --non-interactive --split-ratio 1,0,0
    --sample-type CrudeWebdataset --force-overwrite``."""
    return [
        sys.executable, "-m", "megatron.energon.cli.main", "prepare", str(dataset_dir),
        "--non-interactive", "--split-ratio", split_ratio, "--sample-type", "CrudeWebdataset",
        "--force-overwrite", "--num-workers", str(num_workers), "--no-progress",
    ]


def run_energon_prepare(dataset_dir: str | Path, split_ratio: str = "1,0,0", num_workers: int = 1) -> None:
    """Raise with energon's output if it fails."""
    dataset_dir = Path(dataset_dir)
    if not any(dataset_dir.rglob("*.tar")):
        raise FileNotFoundError(f"{dataset_dir}: no .tar shards to prepare")
    result = subprocess.run(
        energon_prepare_command(dataset_dir, split_ratio, num_workers), capture_output=True, text=True
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"energon prepare {dataset_dir} failed (exit {result.returncode}):\n{result.stdout}\n{result.stderr}"
        )
