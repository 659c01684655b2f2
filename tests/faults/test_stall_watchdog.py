"""A save that makes no progress for ``train.stall_timeout_s`` ends the run, through the entry point: the
rank's Python stacks (the stuck frame included) are in the log, with what was running, and the exit is
non-zero (3), so Slurm requeues the job. The stall is injected: the save of iteration 2 sleeps 10 minutes."""

from __future__ import annotations

import time

import pytest
from entry import FAULT_ENTRY, run_entry

from dfm.platform.watchdog import STALL_EXIT_CODE, StallWatchdog, stall_timeout


@pytest.mark.slow
def test_a_stalled_save_dumps_the_stacks_and_exits_non_zero(tmp_path):
    args = ["train.train_iters=4", f"checkpoint.save={tmp_path / 'ckpt'}", "checkpoint.save_interval=2"]
    args += ["train.stall_timeout_s=20", f"logger.log_dir={tmp_path / 'logs'}"]
    started = time.monotonic()
    result = run_entry(1, args, entry=FAULT_ENTRY, env={"DFM_TEST_FAULT": "slow_save:2:600"}, timeout=400)
    assert result.returncode == STALL_EXIT_CODE, result.stderr[-3000:]
    assert time.monotonic() - started < 300  # not the injected 10 minutes
    assert "rank 0 made no progress for" in result.stderr and "during the save of iteration 2" in result.stderr
    assert "Thread 0x" in result.stderr or "Current thread" in result.stderr  # faulthandler's stack dump
    assert "in slowly" in result.stderr  # the stuck frame: the injected sleep in the save


def test_the_timeout_in_effect():
    assert stall_timeout(None, on_gpu=True) == 30 * 60 and stall_timeout(None, on_gpu=False) is None
    assert stall_timeout(0, on_gpu=True) is None and stall_timeout(5.0, on_gpu=False) == 5.0
    watchdog = StallWatchdog(None)  # off: beats are free, nothing watches
    watchdog.beat("iteration 1")
    watchdog.stop()
