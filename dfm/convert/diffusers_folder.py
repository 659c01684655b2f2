"""A diffusers model folder on disk: ``config.json`` + safetensors (one file, or shards with an index)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file
from torch import Tensor

from dfm.convert.rules import ConversionError

CONFIG = "config.json"
WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX = WEIGHTS + ".index.json"


def model_folder(path: str | Path) -> Path:
    """The folder holding the model's config.json: ``path`` itself or a pipeline folder's ``transformer/``."""
    path = Path(path)
    for folder in (path, path / "transformer"):
        if (folder / CONFIG).is_file():
            return folder
    raise ConversionError(f"{path} is not a diffusers model folder: no {CONFIG} in it or in {path / 'transformer'}")


def read_diffusers_folder(path: str | Path) -> tuple[dict, dict[str, Tensor]]:
    """(config.json as a dict, every tensor of the weights) of a diffusers model or pipeline folder."""
    folder = model_folder(path)
    config = json.loads((folder / CONFIG).read_text())
    if (folder / INDEX).is_file():
        index = json.loads((folder / INDEX).read_text())
        files = sorted(set(index["weight_map"].values()))
    elif (folder / WEIGHTS).is_file():
        files = [WEIGHTS]
    else:
        raise ConversionError(f"{folder} holds neither {WEIGHTS} nor {INDEX}")
    state: dict[str, Tensor] = {}
    for name in files:
        if not (folder / name).is_file():
            raise ConversionError(f"{folder / INDEX} names {name}, which is missing")
        state.update(load_file(str(folder / name)))
    return config, state


def shard_plan(state: dict[str, Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Keys in order, cut into shards of at most ``max_shard_bytes`` (a larger tensor gets a shard alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_diffusers_folder(
    path: str | Path, config: dict, state: dict[str, Tensor], max_shard_bytes: int = 5 * 2**30
) -> Path:
    """Write what ``<DiffusersClass>.from_pretrained(path)`` loads: config.json + safetensors (+ index)."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tensors = {name: tensor.detach().contiguous() for name, tensor in state.items()}
    shards = shard_plan(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})
        return folder
    weight_map = {}
    for number, names in enumerate(shards, start=1):
        file = f"diffusion_pytorch_model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file({name: tensors[name] for name in names}, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return folder
