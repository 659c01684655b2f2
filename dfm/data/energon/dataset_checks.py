"""Checks on ``dataset.path`` before energon opens it: an energon dataset, fully prepared, no shard cut short.

Each failure names the folder or shard (and the first lost sample key) and the fix, instead of
energon's "Invalid dataset" traceback or a ``tarfile.ReadError`` iterations into training.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import numpy as np

from dfm.data.energon.cooker import BadSampleError, sample_location
from dfm.data.energon.metadata_code import check_metadata_is_data
from dfm.data.prepare.record import check_preparation_complete

META = ".nv-meta"
OFFSET_BYTES = 8  # a .tar.idx is uint64 sample offsets; the last one is where the last sample ends


def check_energon_dataset(path: str | Path, allow_code: bool = False) -> None:
    """``allow_code``: ``dataset.allow_code``, the metadata may name Python for energon to run (metadata_code.py)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset path {path} does not exist")
    check_metadata_is_data(path, allow_code)
    if path.is_file():
        return  # a metadataset .yaml: energon checks the datasets it names
    if not (path / META / "dataset.yaml").is_file():
        shards = " (it holds .tar shards)" if any(path.glob("*.tar")) else ""
        raise FileNotFoundError(
            f"{path} is not an energon dataset: no {META}/dataset.yaml{shards}. Index it with "
            f"`energon prepare {path}`, or prepare it with prepare_energon_dataset.py --run_energon_prepare "
            f"(docs/data.md)"
        )
    check_preparation_complete(path)
    check_shards_complete(path)


def indexed_end(index_file: Path) -> int:
    with index_file.open("rb") as f:
        f.seek(-OFFSET_BYTES, 2)
        return int(np.frombuffer(f.read(OFFSET_BYTES), dtype=np.uint64)[0])


def first_lost_sample(index_file: Path, size: int) -> int:
    offsets = np.fromfile(index_file, dtype=np.uint64)
    return int(np.argmax(offsets[1:] > size))


def sample_key(dataset: Path, shard_id: int, sample_index: int) -> str:
    with sqlite3.connect(f"file:{dataset / META / 'index.sqlite'}?mode=ro", uri=True) as db:
        row = db.execute(
            "SELECT sample_key FROM samples WHERE tar_file_id = ? AND sample_index = ?", (shard_id, sample_index)
        ).fetchone()
    return row[0] if row else f"<sample {sample_index}>"


def check_shards_complete(dataset: Path) -> None:
    """Every shard the index lists is there and as long as the index says (the order of
    ``.info.json`` is energon's shard id)."""
    info = dataset / META / ".info.json"
    if not info.is_file():
        return  # another energon version's layout: energon reports what it finds
    shard_counts = json.loads(info.read_text())["shard_counts"]
    for shard_id, (name, count) in enumerate(shard_counts.items()):
        shard, index_file = dataset / name, dataset / f"{name}.idx"
        if not shard.is_file():
            raise FileNotFoundError(
                f"shard {shard} is listed in the energon index of {dataset} but missing: restore it, or rerun "
                f"`energon prepare {dataset}` to index the shards that are there"
            )
        size = shard.stat().st_size
        if not index_file.is_file() or size >= (expected := indexed_end(index_file)):
            continue
        lost = first_lost_sample(index_file, size)
        raise BadSampleError(
            sample_location(shard, sample_key(dataset, shard_id, lost)),
            f"the shard is truncated ({size} bytes, its index expects {expected}): samples {lost}..{count - 1} of "
            f"it are lost. Re-create it (prepare_energon_dataset.py --resume, then energon prepare), or list "
            f"'{name}' under exclude: in {dataset / META / 'split.yaml'} to train without it",
        )
