"""A checkpoint's manifest: every file's relative path, size and checksum, written last.

``manifest.json`` is written once every rank finished writing, before ``latest`` moves, so
its presence marks a complete save and its entries name the file at fault when one is
truncated, missing or altered. Checksums are xxh64 when ``xxhash`` is installed, else crc32;
the manifest records which.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

from dfm.safe_files import confined_path, write_text_no_follow

MANIFEST = "manifest.json"
# Written by dist_checkpointing for every checkpoint: without them nothing loads.
REQUIRED = ("metadata.json", "common.pt", ".metadata")
CHUNK = 16 << 20

try:
    import xxhash
except ImportError:  # optional: crc32 is slower on large files but always there
    xxhash = None


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the checkpoint directory
    size: int
    checksum: str  # "<algorithm>:<hex digest>"


def checksum(file: Path, algorithm: str | None = None) -> str:
    """``"xxh64:<hex>"`` or ``"crc32:<hex>"`` of the file's bytes, read in chunks."""
    algorithm = algorithm or ("xxh64" if xxhash is not None else "crc32")
    if algorithm == "xxh64":
        digest = xxhash.xxh64()
        with open(file, "rb") as handle:
            while chunk := handle.read(CHUNK):
                digest.update(chunk)
        return f"xxh64:{digest.hexdigest()}"
    crc = 0
    with open(file, "rb") as handle:
        while chunk := handle.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"crc32:{crc:08x}"


def checkpoint_files(directory: Path) -> list[str]:
    """Relative paths of every file in the checkpoint except the manifest, sorted."""
    return sorted(str(f.relative_to(directory)) for f in directory.rglob("*") if f.is_file() and f.name != MANIFEST)


def describe_files(directory: Path, paths: list[str]) -> list[FileEntry]:
    return [FileEntry(path, (directory / path).stat().st_size, checksum(directory / path)) for path in paths]


def write_manifest(directory: Path, entries: list[FileEntry]) -> Path:
    """Atomically write ``directory/manifest.json`` (a crash leaves no half manifest)."""
    body = {"version": 1, "files": [asdict(e) for e in sorted(entries, key=lambda e: e.path)]}
    return write_text_no_follow(directory / MANIFEST, json.dumps(body, indent=1) + "\n", fsync=True)


def has_manifest(directory: Path) -> bool:
    return (directory / MANIFEST).is_file()


def read_manifest(directory: Path) -> list[FileEntry]:
    try:
        body = json.loads((directory / MANIFEST).read_text())
        return [FileEntry(**entry) for entry in body["files"]]
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{directory / MANIFEST} is not a valid manifest ({error})") from error


def manifest_size(directory: Path) -> int | None:
    """Total bytes the manifest lists; None without a (readable) manifest."""
    if not has_manifest(directory):
        return None
    try:
        return sum(entry.size for entry in read_manifest(directory))
    except ValueError:
        return None


def verify(directory: Path, part: tuple[int, int] = (0, 1), checksums: bool = True) -> list[str]:
    """Faults of ``directory`` against its manifest, one line each (empty: it verifies).

    ``part=(index, count)`` checks every count-th file from ``index``, so ranks can share the
    reading; the manifest and the required files are checked by every part.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return [f"{directory} does not exist"]
    faults = [
        f"{directory / name}: missing (every checkpoint has it)"
        for name in REQUIRED
        if not (directory / name).is_file()
    ]
    if not has_manifest(directory):
        return faults
    try:
        entries = read_manifest(directory)
    except ValueError as error:
        return [*faults, str(error)]
    index, count = part
    for entry in entries[index::count]:
        faults += file_faults(directory, entry, checksums)
    return faults


def file_faults(directory: Path, entry: FileEntry, checksums: bool) -> list[str]:
    file = confined_path(directory, entry.path)
    if file is None:
        return [f"{directory / MANIFEST}: entry {entry.path!r} lies outside the checkpoint folder (not read)"]
    if not file.is_file():
        return [f"{file}: missing (manifest lists {entry.size} bytes)"]
    size = file.stat().st_size
    if size != entry.size:
        return [f"{file}: {size} bytes, manifest expects {entry.size} (truncated or rewritten)"]
    if checksums:
        algorithm = entry.checksum.partition(":")[0]
        if algorithm == "xxh64" and xxhash is None:
            return []  # written where xxhash was installed; sizes still checked
        found = checksum(file, algorithm)
        if found != entry.checksum:
            return [f"{file}: checksum {found}, manifest expects {entry.checksum} (corrupted)"]
    return []
