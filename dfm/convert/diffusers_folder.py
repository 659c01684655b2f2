"""A diffusers model folder on disk: ``config.json`` + safetensors (one file, or shards with an index).

Read and written one tensor at a time (``safetensors_stream.py``); a pipeline folder (``transformer/``
inside) is read like the model folder it holds.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from dfm.convert.rules import ConversionError
from dfm.convert.safetensors_stream import nbytes, read_tensor, tensor_meta, tensor_names, write_shards

CONFIG = "config.json"
WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX = WEIGHTS + ".index.json"
SUBFOLDER = "transformer"  # where a pipeline folder keeps its denoiser


def model_folder(path: str | Path) -> Path:
    """The folder holding the model's config.json: ``path`` itself or a pipeline folder's ``transformer/``."""
    path = Path(path)
    for folder in (path, path / SUBFOLDER):
        if (folder / CONFIG).is_file():
            return folder
    raise ConversionError(f"{path} is not a diffusers model folder: no {CONFIG} in it or in {path / SUBFOLDER}")


def read_config(path: str | Path, diffusers_class: str | None = None) -> dict:
    """config.json of a model or pipeline folder; with ``diffusers_class``, its ``_class_name`` must be that."""
    file = model_folder(path) / CONFIG
    try:
        config = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConversionError(f"{file}: not a JSON config ({error})") from error
    found = config.get("_class_name") if isinstance(config, dict) else None
    if diffusers_class is not None and found != diffusers_class:
        raise ConversionError(f"{file}: _class_name is {found!r}, this converter reads {diffusers_class} folders")
    return config


class DiffusersWeights:
    """The tensors of a diffusers model (or pipeline) folder, read one at a time; the header of every
    file is read up front, so a missing, truncated or damaged file stops before any conversion."""

    def __init__(self, path: str | Path):
        folder = model_folder(path)
        if (folder / INDEX).is_file():
            try:
                files = sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))
            except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
                raise ConversionError(f"{folder / INDEX}: not a safetensors index ({error!r})") from error
        elif (folder / WEIGHTS).is_file():
            files = [WEIGHTS]
        else:
            raise ConversionError(f"{folder} holds neither {WEIGHTS} nor {INDEX}")
        self.folder, self.file_of = folder, {}
        for name in files:
            if not (folder / name).is_file():
                raise ConversionError(f"{folder / INDEX} names {name}, which is missing")
            self.file_of.update(dict.fromkeys(tensor_names(folder / name), folder / name))

    def names(self) -> list[str]:
        return list(self.file_of)

    def read(self, name: str) -> Tensor:
        return read_tensor(self.file_of[name], name)

    def meta(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        return tensor_meta(self.file_of[name], name)

    def main_dtype(self) -> torch.dtype:
        """The dtype most of the bytes have (what an export gives back by default)."""
        totals: dict[torch.dtype, int] = {}
        for name in self.file_of:
            dtype, shape = self.meta(name)
            totals[dtype] = totals.get(dtype, 0) + nbytes(dtype, shape)
        return max(totals, key=totals.get)


def read_diffusers_folder(path: str | Path) -> tuple[dict, dict[str, Tensor]]:
    """(config.json as a dict, every tensor of the weights) of a diffusers model or pipeline folder."""
    weights = DiffusersWeights(path)
    return read_config(path), {name: weights.read(name) for name in weights.names()}


Plan = dict[str, tuple[torch.dtype, tuple[int, ...]]]


def shard_plan(plan: Plan, max_shard_bytes: int) -> list[Plan]:
    """``plan`` in order, cut into shards of at most ``max_shard_bytes`` (a larger tensor gets a shard alone)."""
    shards: list[Plan] = [{}]
    size = 0
    for name, (dtype, shape) in plan.items():
        tensor_bytes = nbytes(dtype, shape)
        if shards[-1] and size + tensor_bytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = (dtype, shape)
        size += tensor_bytes
    return shards


def write_diffusers_folder_streaming(
    folder: Path, config: dict, plan: Plan, tensors: Iterator[tuple[str, Tensor]], max_shard_bytes: int = 5 * 2**30
) -> Path:
    """Write what ``<DiffusersClass>.from_pretrained(folder)`` loads: config.json + safetensors (+ index).

    ``plan``: every tensor's (dtype, shape) in the order ``tensors`` yields them; one tensor is held at a time.
    """
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shards = shard_plan(plan, max_shard_bytes)
    if len(shards) == 1:
        write_shards(folder, [WEIGHTS], shards, tensors)
        return folder
    names = [f"diffusion_pytorch_model-{n:05d}-of-{len(shards):05d}.safetensors" for n in range(1, len(shards) + 1)]
    write_shards(folder, names, shards, tensors)
    weight_map = {name: file for file, shard in zip(names, shards) for name in shard}
    total = sum(nbytes(dtype, shape) for dtype, shape in plan.values())
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return folder


def write_diffusers_folder(
    path: str | Path, config: dict, state: dict[str, Tensor], max_shard_bytes: int = 5 * 2**30
) -> Path:
    """``write_diffusers_folder_streaming`` of tensors already in memory."""
    plan = {name: (tensor.dtype, tuple(tensor.shape)) for name, tensor in state.items()}
    return write_diffusers_folder_streaming(Path(path), config, plan, iter(state.items()), max_shard_bytes)
