"""A really full disk (a 2 MiB tmpfs, smaller than the tiny model's first checkpoint), through the entry point:
the save fails with dfm's message (the error, bytes written and free), its partial folder is removed (the
space comes back), the lock is released, and the next start is not blocked by anything the failure left.

Needs permission to mount a tmpfs (root, as in the CI container); skipped otherwise."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from entry import run_entry

from dfm.checkpoint.root_lock import LOCK


@pytest.fixture
def tiny_disk(tmp_path) -> Path:
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount_point)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.mark.slow
@pytest.mark.parametrize("save", ["sync", "async"])
def test_a_full_disk_fails_the_save_named_removes_it_and_blocks_no_restart(tiny_disk, tmp_path, save):
    root = tiny_disk / "ckpt"
    args = ["train.train_iters=1", f"checkpoint.save={root}", "checkpoint.save_interval=1"]
    args += [f"checkpoint.async_save={save == 'async'}"]
    for attempt in ("first", "requeue"):
        result = run_entry(1, [*args, f"logger.log_dir={tmp_path / attempt}"], timeout=300)
        assert result.returncode != 0
        message = f"saving checkpoint {root / 'iter_0000001'} failed: No space left on device"
        assert message in result.stderr, result.stderr[-3000:]
        assert "when it failed" in result.stderr and f"free under {root}" in result.stderr
        assert sorted(p.name for p in root.iterdir()) == ["config.yaml"]  # no partial folder, no lock
        assert not (root / LOCK).exists()
