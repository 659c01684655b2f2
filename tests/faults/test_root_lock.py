"""One run per checkpoint root: a second start on a root held by a live run is refused naming it and
touches nothing; a stale lock (dead pid on this host, or a reused pid) is taken over with a warning; a lock
from another host is never taken over."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from entry import run_entry

from dfm.checkpoint.errors import CheckpointError
from dfm.checkpoint.root_lock import LOCK, acquire, release, root_locked


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``root`` with its bytes and modification time."""
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def first_runs_files(root: Path) -> None:
    """What a running first run has in its root: a complete checkpoint, 'latest', and a save in flight."""
    for name in ("iter_0000002", "iter_0000004"):
        (root / name).mkdir(parents=True)
        (root / name / "__0_0.distcp").write_bytes(b"tensors")
    (root / "iter_0000002" / "manifest.json").write_text("{}")
    (root / "latest").write_text("2")
    (root / "config.yaml").write_text("first: run\n")


@pytest.mark.slow
def test_a_second_start_is_refused_naming_the_first_and_touches_nothing(tmp_path):
    root = tmp_path / "ckpt"
    first_runs_files(root)
    lock, owner = acquire(root)  # this test process is the first run: alive, on this host
    before = snapshot(root)
    try:
        args = ["train.train_iters=1", f"checkpoint.save={root}", f"logger.log_dir={tmp_path / 'log'}"]
        result = run_entry(1, args)
    finally:
        release(lock, owner)
    assert result.returncode != 0
    assert f"host {owner['host']}, pid {os.getpid()}, started {owner['started']}" in result.stderr, result.stderr[
        -3000:
    ]
    assert "is in use by another run" in result.stderr
    lock_file = before.pop(LOCK)
    assert lock_file[0] and snapshot(root) == before  # nothing of the first run was touched
    assert not (tmp_path / "log").exists()


def write_lock(root: Path, **owner) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    record = {"host": socket.gethostname(), "pid": os.getpid(), "process_start": None, "started": "earlier", **owner}
    (root / LOCK).write_text(json.dumps(record))
    return root / LOCK


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


@pytest.mark.parametrize("stale", ["dead pid", "reused pid"])
def test_a_stale_lock_on_this_host_is_taken_over(tmp_path, caplog, stale):
    owner = {"pid": dead_pid()} if stale == "dead pid" else {"process_start": -1}  # our pid, another start
    lock = write_lock(tmp_path, **owner)
    with caplog.at_level(logging.WARNING, logger="dfm.checkpoint"), root_locked(str(tmp_path)):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert f"taking over the stale lock {lock}" in caplog.text
    assert not lock.exists()  # released at the end of the run


def test_a_lock_from_another_host_is_refused_with_how_to_remove_it(tmp_path):
    lock = write_lock(tmp_path, host="elsewhere", pid=1)
    with pytest.raises(CheckpointError, match="another host") as error, root_locked(str(tmp_path)):
        pass
    assert "host elsewhere, pid 1, started earlier" in str(error.value) and f"delete {lock}" in str(error.value)
    assert json.loads(lock.read_text())["host"] == "elsewhere"


def test_a_requeued_slurm_job_takes_over_its_earlier_incarnations_lock(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    lock = write_lock(tmp_path, host="dead-node", pid=1, slurm_job="4242", slurm_restart=0)
    with caplog.at_level(logging.WARNING, logger="dfm.checkpoint"), root_locked(str(tmp_path)):
        assert json.loads(lock.read_text())["slurm_restart"] == 1
    assert f"taking over the stale lock {lock}" in caplog.text


def test_another_slurm_job_on_another_host_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4243")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    write_lock(tmp_path, host="elsewhere", pid=1, slurm_job="4242", slurm_restart=0)
    with pytest.raises(CheckpointError, match="another host"), root_locked(str(tmp_path)):
        pass


def test_an_empty_or_unreadable_lock_of_a_dead_start_is_taken_over(tmp_path, caplog):
    """A start that died while writing its lock (an older dfm; or a full disk) left it empty or garbled."""
    for content in (b"", b'{"host": "vm", "pid'):
        lock = tmp_path / LOCK
        lock.write_bytes(content)
        os.utime(lock, (lock.stat().st_atime - 60, lock.stat().st_mtime - 60))
        with caplog.at_level(logging.WARNING, logger="dfm.checkpoint"), root_locked(str(tmp_path)):
            assert json.loads(lock.read_text())["pid"] == os.getpid()
        assert f"taking over the stale lock {lock} of an unreadable lock file ({len(content)} bytes" in caplog.text
        assert not lock.exists()


def one_start(root: str, started, tried, results, index: int) -> None:
    """What rank 0 of one start does with the lock: take it (or be refused), hold it until every start of
    the trial has tried, release it."""
    started.wait()
    try:
        held = acquire(root)
    except CheckpointError as error:
        results.put((index, "refused" if "in use by another run" in str(error) else str(error)))
        tried.wait()
        return
    results.put((index, "held"))
    tried.wait()
    release(*held)


def race(root_parent: Path, trials: int, starts: int = 10) -> None:
    """``trials`` times ``starts`` starts at once, on a root with no lock, a stale lock or an empty one in
    turn: exactly one holds it each time."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    for trial in range(trials):
        root = root_parent / f"trial{trial}"
        if trial % 3 == 1:
            write_lock(root, process_start=-1)  # this pid, another process start: stale
        elif trial % 3 == 2:
            root.mkdir()
            (root / LOCK).write_bytes(b"")
            os.utime(root / LOCK, (0, 0))
        started, tried, results = context.Barrier(starts), context.Barrier(starts), context.Queue()
        processes = [
            context.Process(target=one_start, args=(str(root), started, tried, results, i)) for i in range(starts)
        ]
        for process in processes:
            process.start()
        outcomes = [results.get(timeout=60) for _ in processes]
        for process in processes:
            process.join(timeout=60)
        held = [index for index, outcome in outcomes if outcome == "held"]
        assert len(held) == 1, (trial, outcomes)
        assert all(outcome in ("held", "refused") for _, outcome in outcomes), outcomes
        assert not (root / LOCK).exists() and not list(root.glob(f"{LOCK}.*"))  # released, no leftovers


def test_starts_racing_for_a_lock_never_both_hold_it(tmp_path):
    """60 starts, 10 at a time. (Before: a start renamed away the fresh lock another had just taken over.)"""
    race(tmp_path, trials=6)


@pytest.mark.slow
def test_200_starts_racing_for_a_lock_never_both_hold_it(tmp_path):
    race(tmp_path, trials=20)
