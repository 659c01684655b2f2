"""Run a test's worker script under torchrun on CPU, writing its results into a folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_worker(worker: Path, nproc: int, out: Path, timeout: int = 300, args: tuple = ()) -> None:
    """``torchrun --nproc-per-node nproc worker *args out`` importing this checkout; fails with its stderr."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    proc = subprocess.run(
        [*command, str(worker), *map(str, args), str(out)], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
