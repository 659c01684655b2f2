"""Checkpoint faults through the real entry point (one process, the tiny model, 4 iterations):
a kill during a save, a damaged newest checkpoint, a full disk, an unfinished first save, a
resume with another model, and SIGTERM."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from entry import FAULT_ENTRY, RECIPE_DIR, entry_command, entry_env, read_metrics, run_entry

ITERS = ["train.train_iters=4"]


def train(tmp: Path, name: str, overrides: list[str], **kwargs) -> tuple[subprocess.CompletedProcess, dict]:
    """Run the entry point once; -> (the process, {iteration: loss})."""
    log_dir = tmp / name
    result = run_entry(1, [*ITERS, *overrides, f"logger.log_dir={log_dir}"], **kwargs)
    metrics = log_dir / "metrics.jsonl"
    return result, {r["iteration"]: r["loss"] for r in read_metrics(log_dir)} if metrics.exists() else {}


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stderr[-4000:]


def latest(root: Path) -> int:
    return int((root / "latest").read_text())


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, dict]:
    """4 iterations uninterrupted, checkpoints at 2 and 4: the reference losses."""
    tmp = tmp_path_factory.mktemp("straight")
    result, losses = train(tmp, "logs", [f"checkpoint.save={tmp / 'ckpt'}", "checkpoint.save_interval=2"])
    assert_ok(result)
    return tmp / "ckpt", losses


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_skipped_and_resume_is_exact(tmp_path, straight):
    root, losses = straight
    copy = tmp_path / "ckpt"
    shutil.copytree(root, copy)
    shard = copy / "iter_0000004" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    result, resumed = train(tmp_path, "resumed", [f"checkpoint.load={copy}"])
    assert_ok(result)
    assert f"skipping checkpoint {copy / 'iter_0000004'}: {shard}: 1000 bytes, manifest expects" in result.stderr
    assert resumed == {3: losses[3], 4: losses[4]}


@pytest.mark.slow
@pytest.mark.parametrize("when", ["before_write", "after_write", "before_latest"])
def test_kill_during_save_keeps_latest_and_resume_is_exact(tmp_path, straight, when):
    _, losses = straight
    root = tmp_path / "ckpt"
    save = [f"checkpoint.save={root}", "checkpoint.save_interval=2"]
    env = {"DFM_TEST_FAULT": f"kill_during_save:0:4:{when}"}
    result, _ = train(tmp_path, "crash", save, entry=FAULT_ENTRY, env=env)
    assert result.returncode != 0
    assert latest(root) == 2
    result, resumed = train(tmp_path, "resumed", [*save, f"checkpoint.load={root}"])
    assert_ok(result)
    if when == "after_write":
        assert "iter_0000004 has no manifest and is newer than 'latest'" in result.stderr
        assert len(list(root.glob("iter_0000004.partial-*"))) == 1
    assert resumed == {3: losses[3], 4: losses[4]}
    assert latest(root) == 4


@pytest.mark.slow
def test_disk_full_during_a_save_leaves_latest_and_removes_the_partial(tmp_path):
    root = tmp_path / "ckpt"
    env = {"DFM_TEST_FAULT": "enospc_during_save:4"}
    save = [f"checkpoint.save={root}", "checkpoint.save_interval=2"]
    result, _ = train(tmp_path, "full", save, entry=FAULT_ENTRY, env=env)
    assert result.returncode != 0
    assert f"saving checkpoint {root / 'iter_0000004'} failed: No space left on device" in result.stderr
    assert "'latest' still names 2" in result.stderr
    assert latest(root) == 2 and not (root / "iter_0000004").exists()


@pytest.mark.slow
def test_an_unfinished_first_save_does_not_block_the_requeue_and_keep_last_keeps_the_newest(tmp_path):
    root = tmp_path / "ckpt"
    (root / "iter_0000005").mkdir(parents=True)
    (root / "iter_0000005" / "common.pt").touch()
    overrides = [f"checkpoint.save={root}", f"checkpoint.load={root}", "checkpoint.save_interval=1"]
    result, losses = train(tmp_path, "requeue", [*overrides, "checkpoint.keep_last=1", "train.train_iters=2"])
    assert_ok(result)
    assert "iter_0000005 has no manifest" in result.stderr and sorted(losses) == [1, 2]
    assert sorted(p.name for p in root.glob("iter_*") if "partial" not in p.name) == ["iter_0000002"]
    assert latest(root) == 2


@pytest.mark.slow
def test_resume_refuses_a_different_model(tmp_path, straight):
    root, _ = straight
    result, _ = train(tmp_path, "other", [f"checkpoint.load={root}", "model.num_layers=1", "model.hidden_size=32"])
    assert result.returncode != 0
    assert "model.num_layers: checkpoint 2, this run 1" in result.stderr
    assert "model.hidden_size: checkpoint 64, this run 32" in result.stderr


@pytest.mark.slow
def test_sigterm_saves_and_exits_cleanly(tmp_path):
    save, log_dir = tmp_path / "ckpt", tmp_path / "logs"
    cmd = entry_command(1, ["train.train_iters=100000", f"checkpoint.save={save}", f"logger.log_dir={log_dir}"])
    proc = subprocess.Popen(
        cmd, cwd=RECIPE_DIR, env=entry_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 300
    while not (log_dir / "metrics.jsonl").exists() or len(read_metrics(log_dir)) < 2:
        assert proc.poll() is None and time.time() < deadline, "training did not start"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-4000:]
    stopped_at = latest(save)
    assert read_metrics(log_dir)[-1]["iteration"] == stopped_at < 100000
    assert (save / f"iter_{stopped_at:07d}" / "manifest.json").exists()
