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
from megatron.core.transformer.utils import sharded_state_dict_default

from dfm.checkpoint import fsdp_state
from dfm.models.common.param_names import global_layer_prefix
from dfm.parallel.layout import layout_of

logger = logging.getLogger("dfm.checkpoint")

# Common-state flag of a checkpoint holding model weights only (``dfm.checkpoint.weights_only``).
WEIGHTS_ONLY = "weights_only"


def _bump_replica_for_stage(sharded: dict[str, Any]) -> None:
    """Embedders replicated on every pipeline stage: only stage 0 holds the main replica."""
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    for value in sharded.values():
        if isinstance(value, ShardedTensor):
            replica = value.replica_id if isinstance(value.replica_id, tuple) else (value.replica_id,)
            value.replica_id = (pp_rank, *replica)


def model_sharded_state_dict(chunk) -> dict[str, Any]:
    """Sharded state dict of one (unwrapped) model chunk: local dict keys, global tensor keys."""
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


def layout(model) -> dict[str, int]:
    """The fingerprint of the layout the (DDP-wrapped) model chunks were built for."""
    return layout_of(model[0].config).fingerprint()


def full_sharded_state_dict(
    model, optimizer, loader, is_loading: bool, with_rng: bool = True, with_data: bool = True, ema=None
) -> dict[str, Any]:
    """Everything sharded: model chunks (+ their EMA), optimizer, per-rank RNG and per-DP-rank data position."""
    state: dict[str, Any] = {}
    model_state: dict[str, Any] = {}
    chunk_states = [_chunk_state(chunk, is_loading) for chunk in model]
    for index, chunk_state in enumerate(chunk_states):
        state[f"model{index}"] = chunk_state
        model_state.update({f"{index}.{k}": v for k, v in chunk_state.items()})
    if ema is not None:
        state.update(ema.sharded_state_dict(chunk_states))
    # Fully reshardable: optimizer state in model space, loadable into any TP/PP/DP layout. The
    # memory-efficient variant gathers over gloo groups on the host, the same on CPU and GPU.
    metadata = {
        "distrib_optim_sharding_type": "fully_reshardable",
        "distrib_optim_fully_reshardable_mem_efficient": True,
    }
    if fsdp_state.is_fsdp(model[0]):
        state["optimizer"] = fsdp_state.optimizer_state(model, optimizer, chunk_states, is_loading)
    else:
        state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=metadata)
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
    return state


def _chunk_state(chunk, is_loading: bool) -> dict[str, Any]:
    if fsdp_state.is_fsdp(chunk):
        return fsdp_state.model_state(chunk, model_sharded_state_dict, is_loading)
    return model_sharded_state_dict(chunk.module)


def with_weights(model_state: dict[str, Any], weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A chunk's sharded state dict restricted to ``weights``' names, holding those tensors under ``ema.<key>``."""
    return {
        name: dataclasses.replace(sharded, key=f"ema.{sharded.key}", data=weights[name])
        for name, sharded in model_state.items()
        if isinstance(sharded, ShardedTensor) and name in weights
    }


def restore_ema(ema, loaded: dict | None, model, directory: Path) -> None:
    """EMA from the checkpoint; a run that turns EMA on mid-way starts it from the loaded weights."""
    if ema is None:
        return
    if loaded is not None:
        ema.load(loaded)
        return
    logger.warning("checkpoint %s has no EMA weights: EMA starts from the loaded model weights", directory)
    ema.reset(model)
