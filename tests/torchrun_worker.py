"""Run a test's worker script as several ranks on CPU (tests/rank_launcher.py), writing its results into a folder."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.rank_launcher import launcher_command

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_worker(worker: Path, nproc: int, out: Path, timeout: int = 300, args: tuple = ()) -> None:
    """``nproc`` ranks of ``worker *args out`` importing this checkout; fails with its stderr."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    command = launcher_command(nproc)
    proc = subprocess.run(
        [*command, str(worker), *map(str, args), str(out)], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
