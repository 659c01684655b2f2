"""Where a conversion writes: a fresh folder next to the target, moved into place only when complete.

An interrupted or failed conversion leaves the target as it was (plus a ``.<name>.*.tmp`` folder
beside it); a finished one replaces it whole, never mixing old and new files. A non-empty target
is replaced only with ``--overwrite`` and only when it holds what that converter writes, so a
mistyped path (a training run, a home folder) is never deleted.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from dfm.convert.rules import ConversionError


def check_target(target: Path, overwrite: bool, replaceable: Callable[[Path], str | None]) -> None:
    """Refuse a non-empty ``target`` unless ``overwrite`` and ``replaceable(target)`` finds nothing wrong
    (it returns None, or why the folder is not the converter's own)."""
    if not target.exists():
        return
    if not target.is_dir():
        raise ConversionError(f"{target} exists and is not a folder")
    if not any(target.iterdir()):
        return
    reason = replaceable(target)
    if reason is not None:
        raise ConversionError(f"{target} is not empty and {reason}: write to a new folder")
    if not overwrite:
        raise ConversionError(f"{target} is not empty: pass --overwrite to replace it, or write to a new folder")


@contextlib.contextmanager
def fresh_folder(target: Path) -> Iterator[Path]:
    """A new empty folder next to ``target``; on success it takes ``target``'s place, on failure it goes."""
    target = target.absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    umask = os.umask(0o022)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)  # mkdtemp's 0700 would otherwise become the target's
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    replace_folder(staging, target)


def replace_folder(new: Path, target: Path) -> None:
    """``new`` renamed to ``target``: an old ``target`` is renamed away first and deleted last, so at
    every moment ``target`` is either the old folder whole, absent, or the new one whole."""
    if not target.exists():
        os.rename(new, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
    os.rename(target, old / "folder")
    os.rename(new, target)
    shutil.rmtree(old)


def diffusers_folder_problem(folder: Path) -> str | None:
    """None when ``folder`` holds only what an export writes (config.json, safetensors and their index; a
    DMD2 student's scheduler_config.json)."""
    for entry in sorted(folder.iterdir()):
        written = entry.name in ("config.json", "scheduler_config.json")
        if entry.is_dir() or not (written or entry.name.endswith((".safetensors", ".index.json"))):
            return f"holds {entry.name}, which an export does not write"
    return None


def weights_only_root_problem(root: Path) -> str | None:
    """None when ``root`` holds only a weights-only checkpoint (what an import writes)."""
    from megatron.core import dist_checkpointing

    from dfm.checkpoint.files import LATEST, iteration_of
    from dfm.checkpoint.state import WEIGHTS_ONLY

    for entry in sorted(root.iterdir()):
        if entry.name == LATEST and entry.is_file():
            continue
        if iteration_of(entry) is None or not entry.is_dir():
            return f"holds {entry.name}, which an import does not write"
        try:
            common = dist_checkpointing.load_common_state_dict(str(entry))
        except Exception:  # noqa: BLE001  (any unreadable checkpoint is not ours to delete)
            common = None
        if not (isinstance(common, dict) and common.get(WEIGHTS_ONLY)):
            return f"holds training checkpoint {entry.name}"
    return None
