"""A save that makes no progress for ``train.stall_timeout_s`` ends the run, through the entry point: the
rank's Python stacks (the stuck frame included) are in the log, with what was running, and the exit is
non-zero (3), so Slurm requeues the job. So does a stop signal during such a save, after
``train.exit_signal_timeout_s``. The stall is injected: the save of iteration 2 sleeps 10 minutes."""

from __future__ import annotations

import re
import subprocess
import time

import pytest
from entry import FAULT_ENTRY, entry_command, kill_group, run_entry, start_faulty_run

from dfm.checkpoint.async_wait import stall_reason
from dfm.platform.watchdog import STALL_EXIT_CODE, StallWatchdog, stall_timeout


def has_frame(log: str, function: str) -> bool:
    """A dumped stack in ``log`` has a frame of ``function``. faulthandler writes a frame's " in " and the
    function's name in separate writes, so two processes dumping at once (two ranks' writers) can split
    them: the name is looked for as a word, not after " in "."""
    return re.search(rf"\b{function}\b", log) is not None


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
    assert has_frame(result.stderr, "slowly")  # the stuck frame: the injected sleep in the save


@pytest.mark.slow
def test_sigterm_during_a_stalled_save_ends_the_run_with_the_stacks(tmp_path):
    """2 ranks; the async save of iteration 2 sleeps in its writer, so the ranks wait for it (the next save,
    or the preemption save) and never get back to the loop that reads the stop signal. SIGTERM to the
    launcher, forwarded to each rank as torchrun's agent forwards it: before dfm/platform/exit_deadline.py
    the ranks ran on until the launcher's SIGKILL (30 s later) with no stacks; now each writes its stacks
    and its writer's and exits 3 once ``train.exit_signal_timeout_s`` has passed."""
    args = ["train.train_iters=1000", f"checkpoint.save={tmp_path / 'ckpt'}", "checkpoint.save_interval=2"]
    args += ["checkpoint.async_save=true", "train.exit_signal_timeout_s=8", f"logger.log_dir={tmp_path / 'logs'}"]
    err = tmp_path / "stderr"
    with err.open("w") as stderr:
        proc = start_faulty_run(entry_command(2, args, entry=FAULT_ENTRY), "slow_save:2:600", stderr)
        try:
            wait_for_stall(err, proc)
            sent = time.monotonic()
            proc.terminate()
            proc.wait(timeout=120)
        finally:
            kill_group(proc.pid)
    log = err.read_text()
    assert time.monotonic() - sent < 28, log[-4000:]  # before the launcher's SIGKILL (30 s)
    assert proc.returncode != 0 and log.count("exitcode : 3") == 2, log[-4000:]
    assert log.count("still running 8 s after SIGTERM (train.exit_signal_timeout_s=8)") == 2, log[-4000:]
    stacks = log[log.find("still running 8 s after SIGTERM") :]  # a failure shows where the ranks were
    assert has_frame(log, "finish_async_saves"), stacks[-8000:]  # the rank's frame: waiting for the writer
    assert has_frame(log, "slowly"), stacks[-8000:]  # the writer's stuck frame, from its own stacks (child_stacks.py)


@pytest.mark.slow
def test_an_async_save_whose_writer_stalls_is_abandoned_and_training_goes_on(tmp_path):
    """2 ranks; the writer of iteration 2's async save sleeps 10 minutes before writing. The ranks wait
    for it at the next save; after ``checkpoint.async_save_timeout_s`` without a byte written they log
    its stacks, stop it, remove its folder and go on: the run ends normally, its later saves complete."""
    root = tmp_path / "ckpt"
    result, seconds = async_saves_every_other_step(tmp_path, "slow_save:2:600", timeout_s=5)
    log = result.stderr
    assert result.returncode == 0, log[-4000:]
    assert seconds < 300  # not the injected 10 minutes
    assert log.count("wrote nothing for 5 s (checkpoint.async_save_timeout_s)") == 2, log[-4000:]
    assert has_frame(log, "slowly"), log[-6000:]  # the stalled writer's frame, from its own stacks
    assert "abandoned the save of" in log and "no checkpoint yet; training goes on" in log, log[-4000:]
    assert not (root / "iter_0000002").exists()
    assert (root / "latest").read_text().strip().endswith("6")
    assert (root / "iter_0000004" / "manifest.json").is_file() and (root / "iter_0000006" / "manifest.json").is_file()


@pytest.mark.slow
def test_a_save_whose_write_worker_dies_is_abandoned_not_waited_on_for_ever(tmp_path):
    """The stall of #45 (a run stopped after an iteration, for good, deaf to SIGTERM) reproduced: megatron's
    writer forks a worker per file and waits for their reports without a timeout
    (``write_preloaded_data_multiproc``'s ``count_queue.join()``); a worker that dies (here it SIGKILLs itself,
    as the OOM killer would end it) leaves the writer, and the rank waiting for it, stuck. Before
    dfm/checkpoint/async_wait.py this run made no progress after iteration 4; now the save is abandoned
    with the writer's stacks (that join) once the writer has had no worker for ``WORKERLESS_S`` (60 s; 15 s
    here, set by the fault, so the test does not idle a minute), well before the 300 s timeout, and the run
    ends normally."""
    root = tmp_path / "ckpt"
    result, seconds = async_saves_every_other_step(tmp_path, "dead_write_worker:2:15", timeout_s=300)
    log = result.stderr
    assert result.returncode == 0, log[-4000:]
    assert seconds < 250  # not the 300 s timeout
    assert "write worker of iter_0000002 dies" in log, log[-4000:]
    assert "has had no worker process and wrote nothing for 15 s (its workers are gone)" in log, log[-4000:]
    assert has_frame(log, "write_preloaded_data_multiproc"), log[-6000:]  # the writer, waiting for its dead worker
    assert not (root / "iter_0000002").exists()
    assert (root / "latest").read_text().strip() == "6"


def async_saves_every_other_step(tmp_path, fault: str, timeout_s: float) -> tuple[subprocess.CompletedProcess, float]:
    """6 iterations on 2 ranks, an async save every 2 into ``tmp_path/ckpt``, with ``fault`` -> (the run, seconds)."""
    args = ["train.train_iters=6", f"checkpoint.save={tmp_path / 'ckpt'}", "checkpoint.save_interval=2"]
    args += ["checkpoint.async_save=true", f"checkpoint.async_save_timeout_s={timeout_s}"]
    started = time.monotonic()
    result = run_entry(
        2, [*args, f"logger.log_dir={tmp_path / 'logs'}"], entry=FAULT_ENTRY, env={"DFM_TEST_FAULT": fault}, timeout=400
    )
    return result, time.monotonic() - started


def wait_for_stall(err, proc: subprocess.Popen, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while err.read_text().count("slow save of iter_0000002 writing") < 2:
        assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-4000:]
        time.sleep(0.1)


def test_the_stall_reasons():
    assert stall_reason(True, 10.0, 10.0, 5.0) == "wrote nothing for 5 s (checkpoint.async_save_timeout_s)"
    assert stall_reason(True, 61.0, 61.0, 900.0).startswith("has had no worker process and wrote nothing for 60 s")
    assert stall_reason(True, 61.0, 30.0, 900.0) is None  # its workers are running (a long write)
    assert stall_reason(True, 30.0, 61.0, 900.0) is None  # bytes came 30 s ago
    assert stall_reason(False, 1e6, 1e6, 5.0) is None  # the writer has exited: nothing to wait for
    assert stall_reason(True, 1e6, 1e6, 0.0) is None and stall_reason(True, 1e6, 1e6, None) is None  # off


def test_the_timeout_in_effect():
    assert stall_timeout(None, on_gpu=True) == 30 * 60 and stall_timeout(None, on_gpu=False) is None
    assert stall_timeout(0, on_gpu=True) is None and stall_timeout(5.0, on_gpu=False) == 5.0
    watchdog = StallWatchdog(None)  # off: beats are free, nothing watches
    watchdog.beat("iteration 1")
    watchdog.stop()
