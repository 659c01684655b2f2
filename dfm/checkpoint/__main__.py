"""``python -m dfm.checkpoint verify DIR``: check one checkpoint or every checkpoint of a root.

Prints one line per checkpoint (``ok`` or what is wrong); exits 1 if any checkpoint is damaged or holds
a pickle that names code (its metadata and per-rank objects are read as data, never run). An unfinished
save (no manifest, newer than ``latest``: a run stopped while saving) is a warning, not a fault, when an
older checkpoint of the root verifies: that is the one a resume takes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dfm.checkpoint.files import Candidate, candidates, is_checkpoint_dir, skip_reason
from dfm.checkpoint.manifest import verify
from dfm.checkpoint.pickle_check import pickled_faults
from dfm.checkpoint.select import candidate_of


def report(candidate: Candidate, checksums: bool) -> tuple[bool, str]:
    """(verifies, the line to print)."""
    name = candidate.directory
    if not candidate.loadable:
        return candidate.status != "partial", f"{name}: skipped on resume: {skip_reason(candidate)}"
    faults = verify(candidate.directory, checksums=checksums) + pickled_faults(candidate.directory)
    if faults:
        return False, f"{name}: DAMAGED: " + "; ".join(faults)
    if candidate.status == "legacy":
        return True, f"{name}: ok (no manifest: written before manifests existed; only its required files checked)"
    return True, f"{name}: ok"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dfm.checkpoint", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("verify", help="check checkpoints against their manifests")
    check.add_argument("directory", type=Path, help="one iter_N checkpoint or a checkpoint root")
    check.add_argument("--sizes-only", action="store_true", help="skip the checksums (fast)")
    args = parser.parse_args(argv)
    directory = args.directory
    if not directory.is_dir():
        print(f"{directory}: no such directory", file=sys.stderr)
        return 2
    listed = [candidate_of(directory)] if is_checkpoint_dir(directory) else candidates(directory)
    if not listed:
        print(f"{directory}: no checkpoints")
        return 0
    results = [report(c, checksums=not args.sizes_only) for c in listed]
    resumable = any(ok and c.loadable for c, (ok, _) in zip(listed, results, strict=True))
    failed = False
    for candidate, (ok, line) in zip(listed, results, strict=True):
        if not ok and candidate.status == "partial" and resumable:
            line = f"{line} (warning: a resume takes the newest checkpoint that verifies)"
        else:
            failed |= not ok
        print(line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
