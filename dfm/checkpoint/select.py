"""Which checkpoint to load: one named directory (it must verify) or the newest of a root that does."""

from __future__ import annotations

import logging
from pathlib import Path

from dfm.checkpoint.collective import decided_on_rank0, gathered, rank, world_size
from dfm.checkpoint.errors import CheckpointError
from dfm.checkpoint.files import Candidate, candidates, is_checkpoint_dir, iteration_of, read_latest, skip_reason
from dfm.checkpoint.manifest import has_manifest, verify

logger = logging.getLogger("dfm.checkpoint")

LEGACY_WARNING = "checkpoint %s has no manifest (written before manifests existed): loading it unverified"


def choose_checkpoint(path: str | Path, checksums: bool = True) -> Path | None:
    """The checkpoint ``path`` names (a root: its newest that verifies); None: start from scratch.

    A named ``iter_N`` directory that does not verify raises; a root's damaged or unfinished
    checkpoints are skipped with a log line saying why. All ranks share the reading.
    """
    path = Path(path)
    if is_checkpoint_dir(path):
        return checked_directory(path, checksums)
    listed = decided_on_rank0(lambda: candidates(path) if path.is_dir() else [])
    skipped = []
    for candidate in listed:
        reason = "; ".join(faults(candidate.directory, checksums)) if candidate.loadable else skip_reason(candidate)
        if not reason:
            if candidate.status == "legacy":
                log_rank0(logging.WARNING, LEGACY_WARNING, candidate.directory)
            return candidate.directory
        log_rank0(logging.WARNING, "skipping checkpoint %s: %s", candidate.directory, reason)
        skipped.append(candidate.directory.name)
    if skipped:
        log_rank0(
            logging.WARNING,
            "no complete checkpoint under %s (skipped %s): starting from scratch",
            path,
            ", ".join(skipped),
        )
    else:
        log_rank0(logging.INFO, "no checkpoint under %s: starting from scratch", path)
    return None


def checked_directory(directory: Path, checksums: bool) -> Path:
    candidate = decided_on_rank0(lambda: candidate_of(directory))
    problems = faults(directory, checksums) if candidate.loadable else [skip_reason(candidate)]
    if problems:
        raise CheckpointError(
            f"checkpoint {directory} cannot be loaded: {'; '.join(problems)}. Load its root "
            f"(checkpoint.load={directory.parent}) to resume from the newest checkpoint that verifies"
        )
    if candidate.status == "legacy":
        log_rank0(logging.WARNING, LEGACY_WARNING, directory)
    return directory


def candidate_of(directory: Path) -> Candidate:
    """A named directory: complete with a manifest; without one, unfinished only if newer than its root's ``latest``."""
    iteration = iteration_of(directory)
    if has_manifest(directory):
        return Candidate(directory, iteration or 0, "complete")
    latest = read_latest(directory.parent) if iteration is not None else None
    newer = latest is not None and iteration > latest
    return Candidate(directory, iteration or 0, "partial" if newer else "legacy")


def faults(directory: Path, checksums: bool) -> list[str]:
    """``verify`` with the files shared over ranks; every rank gets the whole list."""
    parts = gathered(verify(directory, (rank(), world_size()), checksums))
    return list(dict.fromkeys(fault for part in parts for fault in part))


def resolve_load_dir(path: str | Path) -> Path | None:
    """The checkpoint to read from ``path`` (sizes checked, no checksums: for reading weights only)."""
    return choose_checkpoint(path, checksums=False)


def log_rank0(level: int, message: str, *args) -> None:
    if rank() == 0:
        logger.log(level, message, *args)
