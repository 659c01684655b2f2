"""The checkpoint root on disk: ``<root>/iter_0000010/`` directories and the ``latest`` marker.

A checkpoint is *complete* when its manifest exists (written after every rank finished
writing) or, for checkpoints written without a manifest, when ``latest`` names it or a newer
one. A directory without a manifest newer than ``latest`` is a save that never finished.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from dfm.checkpoint.manifest import MANIFEST, has_manifest, manifest_size
from dfm.safe_files import write_text_no_follow

logger = logging.getLogger("dfm.checkpoint")

LATEST = "latest"
ITERATION_DIR = re.compile(r"iter_(\d{7})")


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def iteration_of(directory: Path) -> int | None:
    match = ITERATION_DIR.fullmatch(directory.name)
    return int(match.group(1)) if match else None


def is_checkpoint_dir(path: Path) -> bool:
    """One checkpoint (not a root): an ``iter_N`` directory or one dist_checkpointing wrote."""
    return iteration_of(path) is not None or (path / "metadata.json").exists() or (path / MANIFEST).exists()


def read_latest(root: str | Path) -> int | None:
    marker = Path(root) / LATEST
    if not marker.exists():
        return None
    text = marker.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{marker} should hold an iteration number, found {text!r}")
    return int(text)


def mark_latest(root: str | Path, iteration: int) -> None:
    """Atomically, never through a link (dfm/safe_files.py)."""
    write_text_no_follow(Path(root) / LATEST, f"{iteration}\n", fsync=True)


@dataclass(frozen=True)
class Candidate:
    """One ``iter_N`` directory of a root and what the root's state says about it."""

    directory: Path
    iteration: int
    status: str  # "complete", "legacy" (complete, no manifest), "partial", "newer than latest"

    @property
    def loadable(self) -> bool:
        return self.status in ("complete", "legacy")


def candidates(root: str | Path) -> list[Candidate]:
    """Every ``iter_N`` directory under ``root``, newest first."""
    root = Path(root)
    latest = read_latest(root)
    found = []
    for directory in root.iterdir() if root.is_dir() else []:
        iteration = iteration_of(directory)
        if iteration is None or directory.is_symlink() or not directory.is_dir():
            continue
        newer = latest is not None and iteration > latest
        if has_manifest(directory):
            status = "newer than latest" if newer else "complete"
        else:
            status = "partial" if latest is None or newer else "legacy"
        found.append(Candidate(directory, iteration, status))
    return sorted(found, key=lambda c: c.iteration, reverse=True)


def skip_reason(candidate: Candidate) -> str:
    if candidate.status == "partial":
        return "no manifest and newer than 'latest': a save that did not finish"
    return f"its manifest exists but 'latest' names an older iteration ({candidate.iteration} > 'latest')"


def set_aside_partial_saves(root: str | Path) -> list[Path]:
    """Rename every unfinished save under ``root`` to ``iter_N.partial-<time>`` (kept for inspection)."""
    moved = []
    for candidate in candidates(root):
        if candidate.status != "partial":
            continue
        target = candidate.directory.with_name(f"{candidate.directory.name}.partial-{time.strftime('%Y%m%dT%H%M%S')}")
        candidate.directory.rename(target)
        logger.warning(
            "checkpoint %s has no manifest and is newer than 'latest' (a save that did not finish): moved to %s; "
            "delete it to free the space",
            candidate.directory,
            target.name,
        )
        moved.append(target)
    return moved


def remove_partial(directory: Path) -> None:
    """Drop what a failed save wrote (every rank may call it; the first one wins)."""
    shutil.rmtree(directory, ignore_errors=True)


def checkpoint_bytes(directory: Path) -> int:
    """Size on disk: the manifest's total, else the files' sizes."""
    size = manifest_size(directory)
    if size is not None:
        return size
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def newest_complete(root: str | Path) -> Path | None:
    return next((c.directory for c in candidates(root) if c.loadable), None)


def room_problem(root: str | Path, needed: int, what: str) -> str | None:
    """None if ``root``'s file system has ``needed`` bytes free, else a message with both numbers."""
    free = shutil.disk_usage(root).free
    if free >= needed:
        return None
    return (
        f"not enough free space under {root} for a checkpoint: {format_bytes(free)} free, {what} needs "
        f"{format_bytes(needed)}; free space there, lower checkpoint.keep_last, or point checkpoint.save elsewhere"
    )


def format_bytes(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024:
            return f"{count:.1f} {unit}" if unit != "B" else f"{count} B"
        count /= 1024
    return f"{count:.1f} TiB"


def prune_checkpoints(root: str | Path, keep_last: int | None, newest: int) -> list[Path]:
    """Keep the ``keep_last`` newest complete checkpoints up to ``newest`` (always kept); delete older ones.

    Checkpoints newer than ``newest`` and unfinished saves are left alone.
    """
    if keep_last is None:
        return []
    older = [c.directory for c in candidates(root) if c.loadable and c.iteration < newest]
    doomed = older[max(keep_last - 1, 0) :]
    for directory in doomed:
        shutil.rmtree(directory, ignore_errors=True)
    return doomed
