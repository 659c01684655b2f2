"""energon's loader state <-> JSON text: the data position a checkpoint keeps, stored as data.

energon's ``save_state_rank()`` is a tree of its state dataclasses, ``FlexState`` dicts, tuples, bytes,
and (with worker processes) RNG states holding a torch tensor and a numpy array. Each is written as a
tagged JSON object; on reading, only the energon state classes listed here are built, so the text can
name no code. A type this codec does not know fails the save naming it (a newer energon), never silently.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
from typing import Any

import numpy as np
import torch

TAG = "$type"


@functools.cache
def state_classes() -> dict[str, type]:
    """The energon state dataclasses a loader state holds, by qualified name."""
    from megatron.energon.flavors.webdataset.sample_loader import SliceState
    from megatron.energon.rng import SystemRngState
    from megatron.energon.savable_loader import SavableDataLoaderState, SavableDatasetCheckpoint, SavableDatasetState

    classes = (SavableDataLoaderState, SavableDatasetCheckpoint, SavableDatasetState, SliceState, SystemRngState)
    return {f"{cls.__module__}.{cls.__qualname__}": cls for cls in classes}


def _array(value: np.ndarray) -> dict:
    return {"dtype": value.dtype.str, "shape": list(value.shape), "data": _b64(np.ascontiguousarray(value).tobytes())}


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def encode(value: Any) -> Any:
    """A JSON-ready form of ``value`` (see the module docstring); raises TypeError for an unknown type."""
    from megatron.energon.state import FlexState

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [encode(item) for item in value]
    if isinstance(value, tuple):
        return {TAG: "tuple", "items": [encode(item) for item in value]}
    if isinstance(value, (bytes, bytearray)):
        return {TAG: "bytes", "data": _b64(bytes(value))}
    if isinstance(value, dict):
        kind = "flex" if isinstance(value, FlexState) else "dict"
        return {TAG: kind, "items": [[encode(k), encode(v)] for k, v in value.items()]}
    if isinstance(value, torch.Tensor):
        return {TAG: "tensor", **_array(value.detach().cpu().numpy())}
    if isinstance(value, np.ndarray):
        return {TAG: "ndarray", **_array(value)}
    name = f"{type(value).__module__}.{type(value).__qualname__}"
    if dataclasses.is_dataclass(value) and state_classes().get(name) is type(value):
        fields = {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {TAG: "state", "class": name, "fields": fields}
    raise TypeError(f"the loader state holds a {name}, which dfm's JSON loader state does not know (energon changed?)")


def decode(value: Any) -> Any:
    """The inverse of ``encode``; builds only the listed energon state classes."""
    from megatron.energon.state import FlexState

    if isinstance(value, list):
        return [decode(item) for item in value]
    if not isinstance(value, dict):
        return value
    kind = value.get(TAG)
    if kind == "tuple":
        return tuple(decode(item) for item in value["items"])
    if kind == "bytes":
        return base64.b64decode(value["data"])
    if kind in ("dict", "flex"):
        items = {_hashable(decode(k)): decode(v) for k, v in value["items"]}
        return FlexState(items) if kind == "flex" else items
    if kind in ("tensor", "ndarray"):
        array = np.frombuffer(base64.b64decode(value["data"]), dtype=np.dtype(value["dtype"])).reshape(value["shape"])
        return torch.from_numpy(array.copy()) if kind == "tensor" else array.copy()
    if kind == "state":
        cls = state_classes().get(value["class"])
        if cls is None:
            raise ValueError(f"loader state names class {value['class']!r}, which is not an energon state class")
        return cls(**{name: decode(field) for name, field in value["fields"].items()})
    raise ValueError(f"loader state holds an object tagged {kind!r}, which dfm does not know")


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


def dumps(state: Any) -> str:
    return json.dumps(encode(state), separators=(",", ":"))


def loads(text: str) -> Any:
    return decode(json.loads(text))
