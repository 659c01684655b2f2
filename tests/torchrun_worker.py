"""Run a test's worker script as several ranks on CPU (tests/rank_launcher.py), writing its results into a folder."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.rank_launcher import launcher_command
from tests.zygote import checkout_env, python_args


def run_worker(
    worker: Path, nproc: int, out: Path, timeout: int = 300, args: tuple = (), shared_imports: bool = True
) -> None:
    """``nproc`` ranks of ``worker *args out`` importing this checkout; fails with its stderr.
    ``shared_imports``: forked from the tests' import server (tests/zygote.py); False for workers that
    measure their own process (memory)."""
    env = checkout_env({**os.environ, "OMP_NUM_THREADS": "1"})
    command = [*launcher_command(nproc), *(python_args() if shared_imports else [])]
    proc = subprocess.run(
        [*command, str(worker), *map(str, args), str(out)], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
