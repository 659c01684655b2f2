"""Pickles read as data: an unpickler that admits only the globals a file kind needs, never code.

``pickle.load`` runs whatever a file names (``os.system`` through ``__reduce__``). Checkpoint metadata
(torch distributed checkpoint ``.metadata``), per-rank objects (megatron ``ShardedObject``: RNG state,
data position) and dataset ``.pickle`` parts are read here instead; anything else a file names is
refused with ``UnsafePickleError`` naming the file (and the global it asked for).
"""

from __future__ import annotations

import functools
import io
import pickle
from collections.abc import Mapping
from typing import IO, Any

import numpy as np
import torch

Globals = Mapping[tuple[str, str], Any]


class UnsafePickleError(pickle.UnpicklingError):
    """A pickle that names something it may not: refused before anything of it ran."""


class RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose ``find_class`` answers only from ``allowed`` {(module, name): object}."""

    def __init__(self, file: IO[bytes], allowed: Globals, source: str) -> None:
        super().__init__(file)
        self.allowed = allowed
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise UnsafePickleError(
                f"{self.source}: refused to load {module}.{name} (only data types are admitted; "
                "a pickle naming anything else could run code)"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"{self.source}: refused a persistent id (not plain data)")


def restricted_load(file: IO[bytes], allowed: Globals, source: str) -> Any:
    """One pickle from ``file``, admitting only ``allowed`` globals; a broken pickle also names ``source``."""
    try:
        return RestrictedUnpickler(file, allowed, source).load()
    except UnsafePickleError:
        raise
    except Exception as error:  # truncated or garbled bytes: any of pickle's many error types
        raise UnsafePickleError(f"{source}: not a readable pickle ({type(error).__name__}: {error})") from error


def _storage_from_bytes(data: bytes) -> Any:
    """``torch.storage._load_from_bytes`` (how a pickled tensor stores its data) without running code."""
    return torch.load(io.BytesIO(data), weights_only=True)


def _numpy_globals() -> dict[tuple[str, str], Any]:
    """numpy arrays and scalars, as numpy 2 and numpy 1 (``numpy.core``) name them."""
    found = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}
    reconstruct, scalar = np.ndarray.__reduce__(np.zeros(1))[0], np.float32(0).__reduce__()[0]
    for core in ("numpy.core.multiarray", "numpy._core.multiarray"):
        found[(core, "_reconstruct")] = reconstruct
        found[(core, "scalar")] = scalar
    # numpy >= 1.25 names a dtype by its class (numpy.dtypes.UInt32DType: numpy's RNG state holds one)
    dtypes = getattr(np, "dtypes", None)
    for name, value in vars(dtypes).items() if dtypes is not None else ():
        if isinstance(value, type) and issubclass(value, np.dtype):
            found[("numpy.dtypes", name)] = value
    return found


@functools.cache
def array_globals() -> dict[tuple[str, str], Any]:
    """What a pickled numpy array or torch tensor (``pickle.dumps(tensor)``) names."""
    from collections import OrderedDict

    return {
        **_numpy_globals(),
        ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
        ("torch.storage", "_load_from_bytes"): _storage_from_bytes,
        ("collections", "OrderedDict"): OrderedDict,
    }


def _dtypes() -> dict[tuple[str, str], Any]:
    return {("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}


@functools.cache
def metadata_globals() -> dict[tuple[str, str], Any]:
    """Every type torch distributed checkpoint ``Metadata`` (and megatron's older variants) holds."""
    from collections import OrderedDict

    from torch.distributed.checkpoint import filesystem, metadata, planner
    from torch.serialization import _get_layout

    from_metadata = (
        "Metadata",
        "StorageMeta",
        "MetadataIndex",
        "ChunkStorageMetadata",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
    from_planner = ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData", "LoadPlan")
    from_planner += ("ReadItem", "LoadItemType")
    found: dict[tuple[str, str], Any] = {
        **{(metadata.__name__, name): getattr(metadata, name) for name in from_metadata},
        **{(planner.__name__, name): getattr(planner, name) for name in from_planner},
        (filesystem.__name__, "_StorageInfo"): filesystem._StorageInfo,
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): _get_layout,
        ("collections", "OrderedDict"): OrderedDict,
        **_dtypes(),
    }
    # Empty placeholder classes megatron keeps so that checkpoints of older releases still load.
    mcore = "megatron.core.dist_checkpointing.strategies.torch"
    for name in ("MCoreMetadata", "MCoreSavePlan"):
        found[(mcore, name)] = _MegatronPlaceholder
    return found


class _MegatronPlaceholder:
    """Stands for megatron's empty ``MCoreMetadata`` / ``MCoreSavePlan`` (no import of megatron needed)."""


def load_checkpoint_metadata(file: IO[bytes]) -> Any:
    """A distributed checkpoint's ``.metadata`` (torch ``Metadata``) from its open file, as data only."""
    return restricted_load(file, metadata_globals(), getattr(file, "name", "checkpoint metadata"))


@functools.cache
def _numpy_types() -> tuple[Any, ...]:
    return tuple(dict.fromkeys(_numpy_globals().values()))


def load_rank_object(data: IO[bytes], source: str) -> Any:
    """A per-rank object (``torch.save`` bytes of RNG state, data position, ...) with torch's weights-only
    loader, numpy arrays admitted (numpy's RNG state is one); refused naming ``source``."""
    try:
        with torch.serialization.safe_globals(list(_numpy_types())):
            return torch.load(data, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as error:
        reason = _reason(error)
        if "global" not in reason.lower():  # garbled bytes, not a refused type
            raise UnsafePickleError(f"{source}: not a readable torch file ({reason})") from error
        raise UnsafePickleError(f"{source}: refused to load ({reason}; only data types are admitted)") from error


def load_weights_only(file, map_location=None, **kwargs) -> Any:
    """``torch.load`` with ``weights_only=True`` whatever the caller or ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``
    asks (an explicit ``weights_only=True`` wins over the variable); a refusal names the file."""
    kwargs.pop("weights_only", None)
    kwargs.pop("pickle_module", None)
    try:
        return torch.load(file, map_location=map_location, weights_only=True, **kwargs)
    except pickle.UnpicklingError as error:
        raise UnsafePickleError(f"{file}: refused to load ({_reason(error)}; only data types are admitted)") from error


def _reason(error: Exception) -> str:
    """The line of torch's weights-only refusal that says what was refused (its first line is generic)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    specific = [line for line in lines if "GLOBAL" in line or "Unsupported" in line or "but got" in line]
    return (specific or lines or [type(error).__name__])[0]


def restricted_loads(data: bytes, allowed: Globals, source: str) -> Any:
    return restricted_load(io.BytesIO(data), allowed, source)


EXTRA_STATE = "_extra_state"


def extra_state_as_data(value: Any, source: str) -> Any:
    """A module's ``_extra_state`` (Transformer Engine's: a uint8 tensor of pickle bytes that its
    ``set_extra_state`` would ``pickle.loads``) read as data, then dropped: the bytes are decoded with the
    array allow-list (anything else is refused naming ``source``) and an empty tensor is returned, so no
    checkpoint byte reaches a module's own unpickler. dfm's fp8 runs no TE module (refused with TE) and its
    own FP8 products keep no scaling state, so TE's fp8 state is rebuilt, never needed from the file.
    ``None`` (megatron's local layers) stays."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):  # megatron keeps some layers' extra state in a list
        return type(value)(extra_state_as_data(item, source) for item in value)
    if isinstance(value, io.BytesIO):  # older TE: torch.save bytes, torch.load'ed by set_extra_state
        load_rank_object(io.BytesIO(value.getvalue()), source)
        return torch.empty(0, dtype=torch.uint8)
    if isinstance(value, torch.Tensor):
        if value.numel():
            data = value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
            restricted_loads(data, array_globals(), source)
        return torch.empty(0, dtype=torch.uint8)
    raise UnsafePickleError(f"{source}: extra state of type {type(value).__name__} refused (a tensor or None expected)")
