"""safetensors files read and written one tensor at a time, so a conversion holds at most one tensor of them.

Reading opens the file per tensor (``safe_open`` maps it; the mapping, and the file pages it made
resident, go when it closes). Writing puts the header first, computed from every tensor's dtype and
shape, then each tensor's bytes as it arrives: the format (an 8-byte little-endian header length, a
JSON header of ``{name: {dtype, shape, data_offsets}}``, then the data) needs nothing else.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from dfm.convert.rules import ConversionError

DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def nbytes(dtype: torch.dtype, shape: Iterable[int]) -> int:
    return math.prod(shape) * (torch.finfo(dtype).bits if dtype.is_floating_point else torch.iinfo(dtype).bits) // 8


def tensor_names(file: Path) -> list[str]:
    """The tensors ``file`` holds; a truncated or malformed file is refused naming it."""
    try:
        with safe_open(str(file), framework="pt") as handle:
            return list(handle.keys())
    except (SafetensorError, OSError) as error:
        raise ConversionError(f"{file}: not a readable safetensors file ({error}); truncated or damaged?") from error


def read_tensor(file: Path, name: str) -> Tensor:
    """Tensor ``name`` of ``file`` (a copy in memory; the file is closed again)."""
    try:
        with safe_open(str(file), framework="pt") as handle:
            return handle.get_tensor(name)
    except (SafetensorError, OSError, RuntimeError) as error:
        raise ConversionError(f"{file}: cannot read tensor {name!r} ({error})") from error


def tensor_meta(file: Path, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
    """(dtype, shape) of tensor ``name`` of ``file``, from the header only."""
    with safe_open(str(file), framework="pt") as handle:
        sliced = handle.get_slice(name)
        dtype = {code: dtype for dtype, code in DTYPES.items()}[sliced.get_dtype()]
        return dtype, tuple(sliced.get_shape())


class StreamingWriter:
    """One safetensors file whose tensors are announced first (``plan``: name -> (dtype, shape)) and
    written in that order with ``write``; ``close`` checks that every one came."""

    def __init__(self, path: Path, plan: dict[str, tuple[torch.dtype, tuple[int, ...]]], metadata: dict | None = None):
        header: dict = {"__metadata__": metadata} if metadata else {}
        offset = 0
        for name, (dtype, shape) in plan.items():
            size = nbytes(dtype, shape)
            header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.path, self.plan, self.pending = path, plan, iter(plan)
        self.file = open(path, "wb")  # noqa: SIM115  (closed by close())
        self.file.write(struct.pack("<Q", len(encoded)) + encoded)

    def write(self, name: str, tensor: Tensor) -> None:
        expected = next(self.pending, None)
        dtype, shape = self.plan.get(name, (None, None))
        if name != expected or tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise ConversionError(f"{self.path}: got {name} {tensor.dtype} {tuple(tensor.shape)}, expected {expected}")
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        self.file.write(memoryview(data.numpy()))

    def close(self) -> None:
        left = list(self.pending)
        self.file.close()
        if left:
            raise ConversionError(f"{self.path}: {len(left)} tensor(s) never written, e.g. {left[:3]}")


def write_shards(
    folder: Path,
    file_names: list[str],
    plans: list[dict[str, tuple[torch.dtype, tuple[int, ...]]]],
    tensors: Iterator[tuple[str, Tensor]],
) -> None:
    """Write ``tensors`` (in the plans' order) into one file per plan, each closed before the next opens."""
    for file_name, plan in zip(file_names, plans):
        writer = StreamingWriter(folder / file_name, plan, metadata={"format": "pt"})
        for _ in plan:
            writer.write(*next(tensors))
        writer.close()
