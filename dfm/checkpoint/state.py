"""What a checkpoint holds, as megatron-core sharded state dicts: model chunks, EMA, optimizer,
per-rank RNG and per-data-parallel-rank data position.

Model tensors carry global names (``layers.<global index>``), so a checkpoint loads into any
TP / PP / DP layout (dist_checkpointing reshards).
"""

from __future__ import annotations

import dataclasses
import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding
from megatron.core.transformer.utils import sharded_state_dict_default

from dfm.checkpoint import distopt_state, fsdp_state
from dfm.checkpoint.pieces import without_empty
from dfm.models.common.param_names import global_layer_prefix
from dfm.parallel.fsdp_shards import install_main_weights
from dfm.parallel.layout import layout_of

logger = logging.getLogger("dfm.checkpoint")

# Common-state flag of a checkpoint holding model weights only (``dfm.checkpoint.weights_only``).
WEIGHTS_ONLY = "weights_only"
# Common-state key: the names of the further trained models a checkpoint holds (``TrainingState.companions``).
COMPANIONS = "companions"


def _bump_replica_for_stage(sharded: dict[str, Any]) -> None:
    """Embedders replicated on every pipeline stage: only stage 0 holds the main replica."""
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    for value in sharded.values():
        if isinstance(value, ShardedTensor):
            replica = value.replica_id if isinstance(value.replica_id, tuple) else (value.replica_id,)
            value.replica_id = (pp_rank, *replica)


def model_sharded_state_dict(chunk) -> dict[str, Any]:
    """Sharded state dict of one (unwrapped) model chunk: local dict keys, global tensor keys. A
    model of submodels (both Wan 2.2 experts) holds each one's under its name as prefix."""
    if hasattr(chunk, "submodels"):
        return submodels_sharded_state_dict(chunk)
    state: dict[str, Any] = {}
    for name, child in chunk.named_children():
        if name == "layers":
            for local, layer in enumerate(child):
                global_prefix = global_layer_prefix(chunk.layer_offset, local)
                for key, value in layer.sharded_state_dict(prefix=global_prefix).items():
                    state[f"layers.{local}." + key[len(global_prefix) :]] = value
            continue
        # tp_group given explicitly: megatron 0.16.1 otherwise marks every TP rank a main replica.
        part = sharded_state_dict_default(
            child, prefix=f"{name}.", tp_group=parallel_state.get_tensor_model_parallel_group()
        )
        if any(getattr(p, "pipeline_parallel", False) for p in child.parameters()):
            _bump_replica_for_stage(part)
        state.update(part)
    return state


def submodels_sharded_state_dict(chunk) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for name, submodel in chunk.submodels().items():
        part = model_sharded_state_dict(submodel)
        add_prefix_for_sharding(part, f"{name}.")
        state.update({f"{name}.{key}": value for key, value in part.items()})
    return state


def _rank_object(key: str, data: Any, index: int, count: int, replica: tuple[int, ...] | int = 0) -> ShardedObject:
    return ShardedObject(key, data, (count,), (index,), replica_id=replica)


def rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


@dataclasses.dataclass
class TrainingState:
    """What a training checkpoint saves and restores: the (DDP-wrapped) model chunks, megatron's
    optimizer and LR schedule, the data loader (its position) and the EMA weights (None: none kept)."""

    model: list
    optimizer: Any
    scheduler: Any
    loader: Any
    ema: Any = None
    # Further trained models of the run, saved in the same checkpoint under their names (a distillation's critic).
    companions: dict[str, Companion] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Companion:
    """A further trained model of a run: its (DDP-wrapped) chunks, megatron optimizer and LR schedule. Its
    sharded keys carry its name as prefix; the run's RNG and data position are saved once, with the run's."""

    model: list
    optimizer: Any
    scheduler: Any

    def sharded_state(self, name: str, is_loading: bool) -> CheckpointState:
        """Model and optimizer as ``full_sharded_state_dict`` gives them, every sharded key prefixed ``<name>.``."""
        checkpoint = full_sharded_state_dict(
            self.model, self.optimizer, None, is_loading, with_rng=False, with_data=False
        )
        add_prefix_for_sharding(checkpoint.state, f"{name}.")
        return checkpoint


def layout(model) -> dict[str, int]:
    """The fingerprint of the layout the (DDP-wrapped) model chunks were built for."""
    return layout_of(model[0].config).fingerprint()


@dataclasses.dataclass
class CheckpointState:
    """A run's sharded state dict and, per chunk, what this rank holds of each parameter (its piece of
    the model weight, main weight and moments: ``dfm.checkpoint.pieces``) for the loader to install."""

    state: dict[str, Any]
    owned: list  # FSDP: per chunk {name: Owned}; distributed optimizer: per optimizer [(param, Owned)]
    fsdp: bool


def full_sharded_state_dict(
    model, optimizer, loader, is_loading: bool, with_rng: bool = True, with_data: bool = True, ema=None
) -> CheckpointState:
    """Everything sharded: model chunks (+ their EMA), optimizer, per-rank RNG and per-DP-rank data position.

    Under Megatron-FSDP and the distributed optimizer every rank writes only what it holds (its
    pieces); a load reads only those too, except a distributed-optimizer rank's model weights,
    which it holds whole (TP-local) anyway.
    """
    if fsdp_state.is_fsdp(model[0]):
        checkpoint = _fsdp_state(model, optimizer, is_loading, ema)
    elif distopt_state.is_distributed(optimizer):
        checkpoint = _distributed_optimizer_state(model, optimizer, is_loading, ema)
    else:  # every rank holds the whole (TP-local) optimizer state: megatron's own format
        chunk_states = [model_sharded_state_dict(chunk.module) for chunk in model]
        state = _model_and_ema(chunk_states, ema)
        model_state = {f"{i}.{k}": v for i, chunk_state in enumerate(chunk_states) for k, v in chunk_state.items()}
        state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=is_loading)
        checkpoint = CheckpointState(state, [], fsdp=False)
    state = checkpoint.state
    if with_rng:  # per rank: only meaningful in the same layout
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        state["rng"] = _rank_object("rng_state", rng_state(), rank, world)
    if with_data:  # per data-parallel rank: needs the same DP size
        dp_rank, dp = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
        replica = (
            parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_context_parallel_rank(),
        )
        state["data"] = _rank_object("data_loader_state", loader.state_dict(), dp_rank, dp, replica)
    return checkpoint


def _model_and_ema(chunk_states: list[dict[str, Any]], ema) -> dict[str, Any]:
    state = {f"model{index}": chunk_state for index, chunk_state in enumerate(chunk_states)}
    if ema is not None:
        state.update(ema.sharded_state_dict(chunk_states))
    return state


def _distributed_optimizer_state(model, optimizer, is_loading: bool, ema) -> CheckpointState:
    """Model weights: each rank's pieces to save; to load, the whole TP-local tensors it holds."""
    chunk_states = [model_sharded_state_dict(chunk.module) for chunk in model]
    parts = distopt_state.owned(optimizer, chunk_states)
    state = _model_and_ema(chunk_states, ema)
    if not is_loading:
        pieces = {id(param): part for inner_parts in parts for param, part in inner_parts}
        in_buffers = distopt_state.in_buffers(optimizer)
        for index, chunk in enumerate(model):
            state[f"model{index}"] = _model_pieces(chunk, chunk_states[index], pieces, in_buffers)
    state["optimizer"] = distopt_state.optimizer_state(optimizer, parts, is_loading)
    return CheckpointState(state, parts, fsdp=False)


def _model_pieces(chunk, chunk_state: dict[str, Any], pieces: dict, in_buffers: set[int]) -> dict[str, Any]:
    """A DDP chunk's model tensors as this rank's pieces of them. A parameter no optimizer updates
    (frozen) and a non-parameter entry are written whole, by their main replica."""
    params = dict(chunk.module.named_parameters())
    result = {}
    for name, sharded in chunk_state.items():
        param = params.get(name)
        if param is not None and id(param) in pieces:
            result[name] = pieces[id(param)].piece.sharded(sharded.key, pieces[id(param)].weight) or None
        elif param is None or id(param) not in in_buffers:
            result[name] = sharded
    return {name: value for name, value in result.items() if value is not None}


def _fsdp_state(model, optimizer, is_loading: bool, ema) -> CheckpointState:
    """Model weights: each rank's rows to save; not read to load (the main weights restore them)."""
    templates = [fsdp_state.model_templates(chunk, model_sharded_state_dict) for chunk in model]
    owned = [
        fsdp_state.owned(chunk, optimizer, chunk_templates, is_loading)
        for chunk, chunk_templates in zip(model, templates)
    ]
    state: dict[str, Any] = {}
    if not is_loading:
        for index, (chunk_owned, chunk_templates) in enumerate(zip(owned, templates)):
            pieces = {name: part.piece.sharded(part.key, part.weight) for name, part in chunk_owned.items()}
            others = {name: value for name, value in chunk_templates.items() if name not in chunk_owned}
            state[f"model{index}"] = {**others, **without_empty(pieces)}  # others: extra states, as they are
    if ema is not None:
        state.update(ema.sharded_pieces(owned))
    param_state = {part.key: without_empty(part.optimizer_sharded()) for parts in owned for part in parts.values()}
    state["optimizer"] = {
        **optimizer.state_dict(),
        "param_state": without_empty(param_state),
        "param_state_sharding_type": distopt_state.SHARDING_TYPE,
    }
    return CheckpointState(state, owned, fsdp=True)


def with_weights(model_state: dict[str, Any], weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A chunk's sharded state dict restricted to ``weights``' names, holding those tensors under ``ema.<key>``."""
    return {
        name: dataclasses.replace(sharded, key=f"ema.{sharded.key}", data=weights[name])
        for name, sharded in model_state.items()
        if isinstance(sharded, ShardedTensor) and name in weights
    }


def restore_model_and_optimizer(checkpoint: CheckpointState, model, optimizer, loaded: dict[str, Any]) -> None:
    """Install what ``dist_checkpointing.load`` returned for ``checkpoint.state``."""
    if checkpoint.fsdp:  # the model's weights are its main weights
        fsdp_state.load_optimizer(model, optimizer, checkpoint.owned, loaded["optimizer"])
        install_main_weights(model)
        return
    for index, chunk in enumerate(model):
        chunk.module.load_state_dict(loaded[f"model{index}"], strict=True)
    if checkpoint.owned:
        distopt_state.load_optimizer(optimizer, checkpoint.owned, loaded["optimizer"])
    else:
        optimizer.load_state_dict(loaded["optimizer"])


def restore_ema(ema, loaded: dict | None, model, directory: Path, checkpoint: CheckpointState | None = None) -> None:
    """EMA from the checkpoint; a run that turns EMA on mid-way starts it from the loaded weights."""
    if ema is None:
        return
    if loaded is not None:
        ema.load(loaded, checkpoint.owned if checkpoint is not None and checkpoint.fsdp else None)
        return
    logger.warning("checkpoint %s has no EMA weights: EMA starts from the loaded model weights", directory)
    ema.reset(model)
