"""``kill -9`` of the torchrun agent takes its workers (and their forked checkpoint writers) with it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from entry import ENTRY, RECIPE_DIR, TINY, entry_env, kill_group, read_metrics


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
def test_workers_exit_when_the_launcher_is_killed(tmp_path):
    log_dir = tmp_path / "logs"
    overrides = [
        "train.train_iters=100000",
        f"logger.log_dir={log_dir}",
        f"checkpoint.save={tmp_path / 'ckpt'}",
        "checkpoint.save_interval=1",
        "checkpoint.async_save=true",  # forked writers come and go
    ]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    agent = subprocess.Popen(
        [*torchrun, str(ENTRY), "--config-file", str(TINY), "--mock", *overrides],
        cwd=RECIPE_DIR,
        env=entry_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    seen: set[int] = set()
    try:
        deadline = time.time() + 300
        while not (log_dir / "metrics.jsonl").exists() or len(read_metrics(log_dir)) < 3:
            assert agent.poll() is None and time.time() < deadline, "training did not start"
            seen |= {p.pid for p in psutil.Process(agent.pid).children(recursive=True)}
            time.sleep(0.2)
        seen |= {p.pid for p in psutil.Process(agent.pid).children(recursive=True)}
        assert seen, "the agent started no worker"
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        deadline = time.time() + 20
        while any(alive(pid) for pid in seen) and time.time() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in seen if alive(pid)], "workers outlived their launcher"
    finally:
        kill_group(agent.pid)
        for pid in seen:  # workers run in sessions of their own: a failure must not leave them behind
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()
