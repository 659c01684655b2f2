"""Shard parts decoded by dfm, never by webdataset's default decoders, and never as code.

webdataset decodes ``.pth`` with ``torch.load(weights_only=False)`` (unless ``WDS_PYTORCH_WEIGHTS_ONLY=1``)
and ``.pickle`` with ``pickle.loads``: a crafted shard would run code in the loader workers. dfm's
task encoder therefore takes the parts as raw bytes (no energon decoder) and decodes them here:
``.pth`` with torch's weights-only loader, ``.pickle`` admitting numpy arrays and torch tensors only.
``allow_pickle`` (``dataset.allow_pickle``) decodes ``.pickle`` with full pickle, for trusted data only.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from dfm.data.energon.cooker import LATENT_PART, TEXT_PART, BadSampleError, describe_source
from dfm.data.prepare.shards import HUNYUAN_PARTS, IMAGE_CONDITION_PART, POOLED_PART
from dfm.safe_unpickle import UnsafePickleError, array_globals, load_rank_object, restricted_loads

TORCH_PARTS = (LATENT_PART, POOLED_PART, *HUNYUAN_PARTS, IMAGE_CONDITION_PART)
PICKLE_PARTS = (TEXT_PART,)


def decode_torch_part(data: bytes, where: str, part: str) -> Any:
    """A ``torch.save`` part (tensor, or numpy array) read as data; refused naming ``where`` and ``part``."""
    try:
        return load_rank_object(io.BytesIO(data), f"part '.{part}'")
    except UnsafePickleError as error:
        raise BadSampleError(where, str(error)) from error
    except (RuntimeError, EOFError, ValueError) as error:
        raise BadSampleError(where, f"part '.{part}' is not a readable torch file ({error})") from error


def decode_pickle_part(data: bytes, where: str, part: str, allow_pickle: bool) -> Any:
    """A ``.pickle`` part: numpy arrays and torch tensors only, unless ``allow_pickle`` (trusted data)."""
    if allow_pickle:
        return pickle.loads(data)
    try:
        return restricted_loads(data, array_globals(), f"part '.{part}'")
    except UnsafePickleError as error:
        raise BadSampleError(where, str(error)) from error


def decode_parts(crude: dict, allow_pickle: bool = False) -> dict:
    """``crude`` with its tensor parts (raw bytes from the shard) decoded; parts already decoded stay."""
    decoded = dict(crude)
    for name, value in crude.items():
        if not isinstance(value, (bytes, bytearray)):
            continue
        part = name.removeprefix(".")
        if part in TORCH_PARTS:
            decoded[name] = decode_torch_part(bytes(value), describe_source(crude), part)
        elif part in PICKLE_PARTS:
            decoded[name] = decode_pickle_part(bytes(value), describe_source(crude), part, allow_pickle)
    return decoded
