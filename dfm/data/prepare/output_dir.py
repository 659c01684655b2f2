"""The output folder of a preparation: a fresh one, one cleared first (``overwrite``), or an
interrupted preparation continued (``resume``). Never a mix of two runs.

Under torchrun every rank writes its own files (``rank<RRR>-NNNNNN.tar``, its record, its report),
so a rank leaves the other ranks' files of the same run alone; rank 0 also clears the energon index
and the files of ranks beyond this run's world size. ``overwrite`` deletes only files a preparation
writes (those names); a folder holding anything else is refused, naming every foreign entry.
"""

from __future__ import annotations

import hashlib
import logging
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dfm.data.prepare.record import COMPLETE, PrepareRecord, record_name

logger = logging.getLogger(__name__)

SHARED_CACHE = ".tiny_random_encoders"  # encoders, not samples: kept by --overwrite
RANK_FILE = re.compile(r"^(?:rank(\d{3})-\d{6}\.tar(?:\.partial|\.idx)?|\.dfm_prepare\.rank(\d{3})\.json(?:\.tmp)?)$")
REPORT_FILE = re.compile(r"^prepare_report\.rank(\d+)\.json$")
ENERGON_INDEX = ".nv-meta"


def entry_rank(name: str) -> int | None:
    """The rank that writes this top-level entry, or None."""
    match = RANK_FILE.match(name) or REPORT_FILE.match(name)
    if match is None:
        return None
    return int(next(g for g in match.groups() if g is not None))


def belongs_to_other_rank(name: str, rank: int, world_size: int) -> bool:
    owner = entry_rank(name)
    return owner is not None and owner != rank and owner < world_size


def blocking_entries(out_dir: Path, rank: int, world_size: int) -> list[str]:
    names = sorted(p.name for p in out_dir.iterdir())
    return [n for n in names if n != SHARED_CACHE and not belongs_to_other_rank(n, rank, world_size)]


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():  # a link is removed, never followed
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def foreign_entries(out_dir: Path) -> list[str]:
    """Entries of ``out_dir`` that no preparation writes (not a rank's shard, record or report, the energon
    index or the tiny encoders' cache): ``--overwrite`` must not delete them, nor write beside them."""
    return sorted(
        p.name for p in out_dir.iterdir() if entry_rank(p.name) is None and p.name not in (ENERGON_INDEX, SHARED_CACHE)
    )


def clear_previous_preparation(out_dir: Path, rank: int, world_size: int) -> None:
    """This rank's shards, record and report; on rank 0 also the energon index and the files of ranks
    beyond ``world_size``. Refuses (FileExistsError) a folder holding files a preparation does not write."""
    foreign = foreign_entries(out_dir)
    if foreign:
        raise FileExistsError(
            f"{out_dir} holds files a preparation does not write: {', '.join(foreign)}. --overwrite deletes only "
            "a preparation's own files (rank<RRR>-NNNNNN.tar shards, their records and reports, the energon index "
            ".nv-meta); move those files away or write to a fresh folder"
        )
    for path in sorted(out_dir.iterdir()):
        owner = entry_rank(path.name)
        if owner == rank or (rank == 0 and (path.name == ENERGON_INDEX or (owner is not None and owner >= world_size))):
            remove(path)


def inputs_digest(files: Sequence[Path], input_dir: str | Path) -> str:
    """Identifies the input file list: file indices (sample keys) mean the same files on resume."""
    names = "\n".join(p.relative_to(input_dir).as_posix() for p in files)
    return hashlib.sha256(names.encode()).hexdigest()[:16]


def open_fresh(out_dir: Path, rank: int, world_size: int, args: dict[str, Any], overwrite: bool) -> PrepareRecord:
    if overwrite:
        clear_previous_preparation(out_dir, rank, world_size)
    blocking = blocking_entries(out_dir, rank, world_size)
    if blocking and not overwrite:
        listing = ", ".join(blocking[:5]) + (", ..." if len(blocking) > 5 else "")
        raise FileExistsError(
            f"{out_dir} is not empty ({listing}): preparation writes into a fresh folder. Pass --overwrite to "
            f"clear its shards and energon index first, or --resume to continue an interrupted preparation"
        )
    record = PrepareRecord(rank=rank, world_size=world_size, args=args)
    record.save(out_dir)
    return record


def differing_args(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    return [
        f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)
    ]


def forget_unpublished_shards(out_dir: Path, record: PrepareRecord) -> None:
    """Drop listed shards whose .tar is missing (redone) and delete this rank's partial or unlisted shards."""
    record.shards = {name: idx for name, idx in record.shards.items() if (out_dir / name).is_file()}
    for path in out_dir.iterdir():
        if entry_rank(path.name) == record.rank and path.name.split(".tar")[0] + ".tar" not in record.shards:
            if ".tar" in path.name:
                path.unlink()


def open_resumed(out_dir: Path, rank: int, world_size: int, args: dict[str, Any]) -> PrepareRecord:
    path = out_dir / record_name(rank)
    if not path.is_file():
        own = [n for n in blocking_entries(out_dir, rank, world_size) if entry_rank(n) == rank]
        if own:
            raise FileNotFoundError(
                f"{out_dir}: --resume found rank {rank}'s shards ({', '.join(own[:3])}) but no record "
                f"{record_name(rank)} of what they hold; redo the preparation with --overwrite"
            )
        return open_fresh(out_dir, rank, world_size, args, overwrite=False)
    record = PrepareRecord.load(path)
    changed = differing_args({**record.args, "world_size": record.world_size}, {**args, "world_size": world_size})
    if changed:
        raise ValueError(
            f"{out_dir}: --resume with other settings than the interrupted preparation ({'; '.join(changed)}); "
            f"rerun with the same arguments, or redo it with --overwrite"
        )
    forget_unpublished_shards(out_dir, record)
    if record.status == COMPLETE:
        logger.info("%s: rank %d already complete (%d samples); nothing to resume", out_dir, rank, record.written)
    record.save(out_dir)
    return record


def open_output_dir(
    out_dir: str | Path, rank: int, world_size: int, args: dict[str, Any], overwrite: bool, resume: bool
) -> PrepareRecord:
    """-> this rank's record, after making sure nothing from another run is mixed in."""
    if overwrite and resume:
        raise ValueError("--overwrite and --resume exclude each other")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if resume:
        return open_resumed(out_dir, rank, world_size, args)
    return open_fresh(out_dir, rank, world_size, args, overwrite)
