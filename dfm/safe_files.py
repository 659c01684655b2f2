"""Files dfm writes into a folder it owns (a checkpoint root), never through a symbolic link.

A link placed in a checkpoint root (``.latest.tmp`` or ``config.yaml`` pointing at a file elsewhere) would
make an ordinary write overwrite that file. dfm writes each of its files to a fresh temporary name created
with ``O_EXCL | O_NOFOLLOW`` and renames it over the target (a rename replaces a link, it never writes
through one); a root holding links that point outside it is refused at start-up, naming them; paths read
from a checkpoint's own files (its manifest) must stay inside the checkpoint folder.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_text_no_follow(path: str | Path, text: str, fsync: bool = False) -> Path:
    """Atomically replace ``path`` with ``text``; a link at ``path`` is replaced, never written through."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            if fsync:
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as error:  # a full disk, say: named with the file dfm was writing
        tmp.unlink(missing_ok=True)
        raise OSError(error.errno, f"writing {path} failed: {error.strerror or error}", str(path)) from error
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def is_inside(path: str | Path, folder: str | Path) -> bool:
    """Whether ``path``, links resolved, lies in ``folder`` (links resolved)."""
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(folder))


def links_leaving(folder: str | Path) -> list[str]:
    """Every symbolic link under ``folder`` (not followed) that points outside it, as ``'link -> target'``."""
    folder = Path(folder)
    found = []
    for parent, dirs, files in os.walk(folder, followlinks=False):
        for name in sorted(dirs + files):
            entry = Path(parent) / name
            if entry.is_symlink() and not is_inside(entry, folder):
                found.append(f"{entry} -> {os.readlink(entry)}")
    return found


def confined_path(folder: str | Path, relative: str) -> Path | None:
    """``folder / relative`` if that stays inside ``folder`` (no absolute path, no ``..``, no link out), else None."""
    candidate = Path(relative)
    if candidate.is_absolute() or ".." in candidate.parts:
        return None
    path = Path(folder) / candidate
    return path if is_inside(path, folder) else None
