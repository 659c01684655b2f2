"""A dataset's energon metadata read as data: no Python named by a dataset folder runs unless allowed.

energon loads the Python a dataset's ``.nv-meta/dataset.yaml`` names (``part_filter: filter.py:fn``,
``sample_loader: loader.py:fn``: files it ``eval``s) and imports any module a ``__module__`` key names.
Before energon opens ``dataset.path`` (a folder or a metadataset ``.yaml``), every metadata file it will
read is parsed here with energon's own YAML reader and searched for such references; one found is refused
naming the file and the key, unless ``dataset.allow_code=true`` (trusted data only).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

META = ".nv-meta"
ENERGON_MODULE = "megatron.energon"  # energon's own classes (CrudeWebdataset, MetadatasetV2, ...): data
CODE_KEYS = ("sample_loader", "__function__")  # always a function to call
ALLOW = "dataset.allow_code=true"


class DatasetCodeError(ValueError):
    """A dataset's metadata names code; refused before energon reads it."""


def _references(node: Any, where: str) -> Iterator[str]:
    """Every key of ``node`` (parsed YAML) that names code, as ``'key.path: value'``."""
    if isinstance(node, list):
        for index, item in enumerate(node):
            yield from _references(item, f"{where}[{index}]")
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        path = f"{where}.{key}" if where else str(key)
        if key in CODE_KEYS:
            yield f"{path}: {value!r} (names a function)"
        elif key == "part_filter" and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            yield f"{path}: {value!r} (names a function; a list of part names is data)"
        elif key == "__module__" and not (
            isinstance(value, str) and (value == ENERGON_MODULE or value.startswith(ENERGON_MODULE + "."))
        ):
            yield f"{path}: {value!r} (imports a module other than {ENERGON_MODULE})"
        else:
            yield from _references(value, path)


def _read(file: Path) -> Any:
    from megatron.energon.eyaml import load_yaml  # the parser energon itself reads these files with

    try:
        return load_yaml(file.read_bytes())
    except Exception as error:  # any parse error of the YAML / JSON library
        raise DatasetCodeError(f"{file}: not readable as YAML ({type(error).__name__}: {error})") from error


def _dataset_folders(node: Any, base: Path) -> Iterator[tuple[Path, str | None]]:
    """(path, its ``dataset_config``) of every ``path:`` entry of a metadataset, resolved against ``base``."""
    if isinstance(node, list):
        for item in node:
            yield from _dataset_folders(item, base)
    elif isinstance(node, dict):
        if isinstance(node.get("path"), str):
            config = node.get("dataset_config")
            yield base / node["path"], config if isinstance(config, str) else None
        for key, value in node.items():
            if key != "path":
                yield from _dataset_folders(value, base)


def code_references(path: str | Path, _seen: set[Path] | None = None) -> list[str]:
    """Every code reference in the metadata energon reads for ``path`` (folder or metadataset), as
    ``'<file>: <key>: <value> (...)'``."""
    path = Path(path)
    seen = _seen if _seen is not None else set()
    if path.resolve() in seen:
        return []
    seen.add(path.resolve())
    found = []
    if path.is_file():  # a metadataset: its own keys, then every dataset (or metadataset) it names
        body = _read(path)
        found += [f"{path}: {ref}" for ref in _references(body, "")]
        for target, config in _dataset_folders(body, path.parent):
            if target.is_dir() or target.suffix in (".yaml", ".yml"):
                found += code_references_of(target, config, seen)
        return found
    return code_references_of(path, None, seen)


def code_references_of(target: Path, dataset_config: str | None, seen: set[Path]) -> list[str]:
    if target.is_file():
        return code_references(target, seen)
    found = []
    names = {dataset_config or "dataset.yaml", "split.yaml"}
    for name in sorted(names):
        file = target / META / name
        if file.is_file():
            found += [f"{file}: {ref}" for ref in _references(_read(file), "")]
    return found


def check_metadata_is_data(path: str | Path, allow_code: bool) -> None:
    """Refuse ``path`` if its energon metadata names code, naming each file and key; ``allow_code``: allowed."""
    if allow_code:
        return
    found = code_references(path)
    if found:
        raise DatasetCodeError(
            f"dataset.path={path}: the dataset's metadata names code that energon would run on load, refused: "
            + "; ".join(found)
            + f". Dataset metadata is read as data; if you trust this dataset and its code, set {ALLOW}"
        )
