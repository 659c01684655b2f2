"""The preparation record: what one rank has finished, so that a run never mixes with another one.

``OUT/.dfm_prepare.rank<RRR>.json`` per rank (rank ``R`` of a ``world_size`` run):
``{"status": "in_progress" | "complete", "rank", "world_size", "args", "shards": {name: [file
indices]}, "skipped": [[file index, path, reason]], "written"}``. A shard enters the record just
before its ``.partial`` file is renamed, so after a crash every finished ``.tar`` is listed and a
listed shard without its ``.tar`` is redone. ``read_preparation_status`` sums the rank records.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RECORD_PATTERN = re.compile(r"^\.dfm_prepare\.rank(\d{3})\.json$")
IN_PROGRESS, COMPLETE = "in_progress", "complete"


def record_name(rank: int) -> str:
    return f".dfm_prepare.rank{rank:03d}.json"


@dataclass
class PrepareRecord:
    rank: int
    world_size: int
    args: dict[str, Any]  # the settings that decide the samples (see pipeline.record_args)
    status: str = IN_PROGRESS
    shards: dict[str, list[int]] = field(default_factory=dict)  # finished shard -> file indices
    skipped: list[tuple[int, str, str]] = field(default_factory=list)  # (file index, path, reason)

    @property
    def written(self) -> int:
        return sum(len(indices) for indices in self.shards.values())

    def done_files(self) -> set[int]:
        return {i for indices in self.shards.values() for i in indices} | {i for i, _, _ in self.skipped}

    def save(self, out_dir: Path) -> None:
        path = out_dir / record_name(self.rank)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({**asdict(self), "written": self.written}, indent=1))
        os.replace(tmp, path)  # atomic: a crash leaves the old or the new record, never half of one

    @classmethod
    def load(cls, path: Path) -> PrepareRecord:
        data = json.loads(path.read_text())
        data.pop("written", None)
        data["skipped"] = [tuple(s) for s in data.get("skipped", [])]
        return cls(**data)


@dataclass
class PreparationStatus:
    records: list[PrepareRecord]

    @property
    def complete(self) -> bool:
        ranks = {r.rank for r in self.records}
        world = {r.world_size for r in self.records}
        return (
            bool(self.records)
            and all(r.status == COMPLETE for r in self.records)
            and len(world) == 1
            and ranks == set(range(world.pop()))
        )

    def describe(self) -> str:
        parts = [f"rank {r.rank}/{r.world_size}: {r.status}, {r.written} samples" for r in self.records]
        return "; ".join(parts) or "no preparation record"


def read_preparation_status(out_dir: str | Path) -> PreparationStatus | None:
    """The rank records under ``out_dir``; None where the folder has none (prepared elsewhere)."""
    paths = sorted(p for p in Path(out_dir).iterdir() if RECORD_PATTERN.match(p.name)) if Path(out_dir).is_dir() else []
    if not paths:
        return None
    return PreparationStatus([PrepareRecord.load(p) for p in paths])


def check_preparation_complete(out_dir: str | Path) -> None:
    """Raise naming the folder and the fix when its preparation record says it is unfinished."""
    status = read_preparation_status(out_dir)
    if status is not None and not status.complete:
        raise RuntimeError(
            f"{out_dir}: the shard preparation did not complete ({status.describe()}); finish it with "
            f"prepare_energon_dataset.py --resume (same arguments) or redo it with --overwrite"
        )
