"""Run ``energon prepare`` on a folder of shards (index + dataset.yaml for a CrudeWebdataset)."""

from __future__ import annotations

import subprocess
import sys
from collections import deque
from pathlib import Path

from dfm.data.prepare.record import check_preparation_complete


def energon_prepare_command(dataset_dir: str | Path, split_ratio: str = "1,0,0", num_workers: int = 1) -> list[str]:
    """The exact command line; same as ``energon prepare DIR --non-interactive --split-ratio 1,0,0
    --sample-type CrudeWebdataset --force-overwrite``."""
    return [
        sys.executable,
        "-m",
        "megatron.energon.cli.main",
        "prepare",
        str(dataset_dir),
        "--non-interactive",
        "--split-ratio",
        split_ratio,
        "--sample-type",
        "CrudeWebdataset",
        "--force-overwrite",
        "--num-workers",
        str(num_workers),
    ]


def run_energon_prepare(dataset_dir: str | Path, split_ratio: str = "1,0,0", num_workers: int = 1) -> None:
    """Index the shards with energon's progress bar shown on our stderr; raise with its output if it fails.
    Refuses a folder whose preparation record says it is unfinished."""
    dataset_dir = Path(dataset_dir)
    if not any(dataset_dir.rglob("*.tar")):
        raise FileNotFoundError(f"{dataset_dir}: no .tar shards to prepare")
    check_preparation_complete(dataset_dir)
    command = energon_prepare_command(dataset_dir, split_ratio, num_workers)
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        tail = deque(maxlen=256)  # the last output chunks, for the error message
        for chunk in iter(lambda: proc.stdout.read1(4096), b""):
            sys.stderr.buffer.write(chunk)
            sys.stderr.flush()
            tail.append(chunk)
    if proc.returncode != 0:
        output = b"".join(tail).decode(errors="replace")
        raise RuntimeError(f"energon prepare {dataset_dir} failed (exit {proc.returncode}):\n{output}")
