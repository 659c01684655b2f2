"""Checkpoint metadata and per-rank objects read as data, never as code (any device).

torch distributed checkpoint reads ``.metadata`` with ``pickle.load`` and every byte object (megatron's
``ShardedObject``: RNG state, data position) with ``torch.load(weights_only=False)``: a crafted checkpoint
would run code on load. These builders route both through ``dfm.safe_unpickle``. megatron reads
``common.pt`` with a plain ``torch.load``, which ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` turns into full
pickle: dfm reads it weights-only whatever the environment says.
"""

from __future__ import annotations

import functools
import os
import types

from dfm.safe_unpickle import (
    EXTRA_STATE,
    UnsafePickleError,
    extra_state_as_data,
    load_checkpoint_metadata,
    load_rank_object,
    load_weights_only,
)


def metadata_pickle_view(original: types.ModuleType) -> types.ModuleType:
    """The ``pickle`` of torch's filesystem storage module, whose ``load`` admits checkpoint-metadata types only."""
    view = types.ModuleType(f"{original.__name__} (checkpoint metadata as data)")
    view.__dict__.update({name: getattr(original, name) for name in dir(original) if not name.startswith("__")})
    view.load = load_checkpoint_metadata
    return view


def objects_as_data(original):
    """Replaces ``DefaultLoadPlanner.load_bytes``: the same placement, the object read by the weights-only loader."""

    @functools.wraps(original)
    def load_bytes(self, read_item, value) -> None:
        fqn = read_item.dest_index.fqn
        file = self.metadata.storage_data[read_item.storage_index].relative_path
        loaded = load_rank_object(value, f"{file}: per-rank object '{fqn}'")
        if fqn.partition("/")[0].endswith(EXTRA_STATE):
            loaded = extra_state_as_data(loaded, f"{file}: extra state '{fqn}'")
        if self.flatten_state_dict:
            from torch.distributed.checkpoint.default_planner import set_element  # the original's helper

            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded

    return load_bytes


def refusals_name_the_directory(original):
    """Wraps ``FileSystemReader.read_data``: a refused object's message gets the checkpoint directory."""

    @functools.wraps(original)
    def read_data(self, plan, planner):
        try:
            return original(self, plan, planner)
        except UnsafePickleError as error:
            raise UnsafePickleError(f"{self.path}/{error}") from error

    return read_data


def weights_only_common(original):
    """Replaces ``TorchCommonLoadStrategy.load_common``: ``common.pt`` read weights-only, whatever the
    environment says, refusals naming the file (megatron's own reads it with a plain ``torch.load``, through
    multistorageclient when that is installed)."""

    @functools.wraps(original)
    def load_common(self, checkpoint_dir):
        from megatron.core.dist_checkpointing.core import CheckpointingException
        from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME

        path = os.path.join(checkpoint_dir, COMMON_STATE_FNAME)
        try:
            return load_weights_only(path, map_location="cpu")
        except FileNotFoundError as error:
            raise CheckpointingException(f"Common file {path} does not exist") from error

    return load_common
