"""Captions from a sidecar ``<name>.json``, a ``.jsonl`` file, a ``meta.json`` manifest, or the file name.

Formats (all paths relative to the input folder; a bare file name also matches):
- sidecar:   ``clip.mp4`` + ``clip.json`` holding ``{"caption": "..."}``
- jsonl:     any ``*.jsonl`` in the input folder, one ``{"file": "clip.mp4", "caption": "..."}`` per line
             (the file may also be named by ``file_name``, ``path``, ``video`` or ``image``; the text may
             sit under ``internvl`` or ``usr`` instead, as NVIDIA AutoModel's preprocessing reads it:
             the first of ``caption``, ``internvl``, ``usr`` present wins)
- meta_json: ``meta.json`` holding a list of such objects, or a ``{"clip.mp4": "caption"}`` mapping
With no format given, all three are looked up in that order. Without any, the caption is the file
stem with underscores replaced by spaces.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

logger = logging.getLogger(__name__)

CaptionFormat = Literal["sidecar", "jsonl", "meta_json"]
CAPTION_FORMATS: tuple[CaptionFormat, ...] = ("sidecar", "jsonl", "meta_json")
FILE_KEYS = ("file", "file_name", "path", "video", "image")
CAPTION_KEYS = ("caption", "internvl", "usr")  # AutoModel's order
META_FILE = "meta.json"


@dataclass
class Caption:
    text: str
    source: str  # "sidecar", "jsonl", "meta_json" or "filename"


def caption_from_filename(path: Path) -> str:
    return path.stem.replace("_", " ")


def _entry_file(entry: dict, where: str) -> str:
    for key in FILE_KEYS:
        if key in entry:
            return str(entry[key])
    raise ValueError(f"{where}: entry {entry} names no file (expected one of {FILE_KEYS})")


def _entry_caption(entry: dict, where: str) -> str:
    for key in CAPTION_KEYS:
        if key in entry:
            return str(entry[key])
    raise ValueError(f"{where}: entry {entry} has no caption (expected one of {CAPTION_KEYS})")


def read_text(path: Path) -> str:
    """The UTF-8 text of a caption file; any other encoding is refused naming the file."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text ({error}); re-encode the caption file as UTF-8") from error


def _index_entries(entries: Iterable[dict], where: str) -> dict[str, str]:
    return {_entry_file(e, where): _entry_caption(e, where) for e in entries}


def read_jsonl_captions(input_dir: Path) -> dict[str, str]:
    captions: dict[str, str] = {}
    for jsonl in sorted(input_dir.glob("*.jsonl")):
        lines = [line for line in read_text(jsonl).splitlines() if line.strip()]
        entries = []
        for number, line in enumerate(lines, 1):
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(f"{jsonl}:{number}: invalid JSON ({error})") from error
        captions.update(_index_entries(entries, str(jsonl)))
    return captions


def read_meta_json_captions(input_dir: Path) -> dict[str, str]:
    meta = input_dir / META_FILE
    if not meta.is_file():
        return {}
    try:
        content = json.loads(read_text(meta))
    except json.JSONDecodeError as error:
        raise ValueError(f"{meta}: invalid JSON ({error})") from error
    if isinstance(content, dict):
        return {str(k): str(v) for k, v in content.items()}
    if isinstance(content, list):
        return _index_entries(content, str(meta))
    raise ValueError(f"{meta}: expected a list of entries or a file -> caption mapping")


def read_sidecar_caption(path: Path) -> str | None:
    sidecar = path.with_suffix(".json")
    if not sidecar.is_file() or sidecar.name == META_FILE:
        return None
    content = json.loads(read_text(sidecar))
    if not isinstance(content, dict) or "caption" not in content:
        raise ValueError(f"{sidecar}: sidecar must be an object with a 'caption' field")
    return str(content["caption"])


class CaptionLookup:
    """Finds the caption of each media file under one input folder."""

    def __init__(self, input_dir: str | Path, caption_format: CaptionFormat | None = None) -> None:
        if caption_format is not None and caption_format not in CAPTION_FORMATS:
            raise ValueError(f"caption_format must be one of {CAPTION_FORMATS}, got {caption_format!r}")
        self.input_dir = Path(input_dir)
        self.formats = CAPTION_FORMATS if caption_format is None else (caption_format,)
        self.tables = {
            "jsonl": read_jsonl_captions(self.input_dir) if "jsonl" in self.formats else {},
            "meta_json": read_meta_json_captions(self.input_dir) if "meta_json" in self.formats else {},
        }

    def _from_table(self, table: dict[str, str], path: Path) -> str | None:
        relative = path.relative_to(self.input_dir).as_posix()
        return table.get(relative, table.get(path.name))

    def caption(self, path: Path) -> Caption:
        for fmt in self.formats:
            text = read_sidecar_caption(path) if fmt == "sidecar" else self._from_table(self.tables[fmt], path)
            if text is not None:
                return Caption(text=text, source=fmt)
        return Caption(text=caption_from_filename(path), source="filename")
