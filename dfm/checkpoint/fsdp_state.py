"""Checkpoint state of Megatron-FSDP chunks, in the same tensors as the distributed optimizer's.

Each data-parallel rank writes and reads only its rows of every TP-local parameter, main weight,
Adam moment and EMA (``dfm.checkpoint.pieces``), under the keys the distributed optimizer uses
(``state.py``): model tensors under their global names, ``optimizer.state.{param,exp_avg,exp_avg_sq}.
<model key>``. So a checkpoint moves between FSDP and the distributed optimizer, and across TP / DP
sizes, in both directions, and no rank ever holds more than its own rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.utils import to_local_if_dtensor

from dfm.checkpoint.pieces import MOMENTS, Owned, Piece, replica_on_every_shard
from dfm.parallel.fsdp_shards import named_parameters, row_range, tp_local_shape


def is_fsdp(chunk) -> bool:
    """Whether ``chunk`` is wrapped by Megatron-FSDP (a bare module, or a stand-in without a DDP config, is not)."""
    return bool(getattr(getattr(chunk, "ddp_config", None), "use_megatron_fsdp", False))


def model_templates(chunk, model_sharded_state_dict) -> dict[str, Any]:
    """The chunk's model sharded state dict for its names and TP placements only (data: stand-ins)."""
    # megatron reads the shapes from the module's parameters: FSDP's compute weights, whose freed
    # buckets leave them empty between steps. Zero-memory stand-ins of the TP-local shapes take their
    # place while the dict is built (a compat patch: dfm/platform/compat/fsdp.py).
    fsdp = chunk.module
    shapes = {name: tp_local_shape(shard) for name, shard in named_parameters(chunk)}
    with fsdp.stand_in_parameters(shapes):
        return model_sharded_state_dict(fsdp.module)


def owned(chunk, optimizer, templates: dict[str, Any], is_loading: bool) -> dict[str, Owned]:
    """Per parameter name: this rank's rows (collective over each parameter's DP group); to load,
    the optimizer's own tensors, so the rows are read in place."""
    state = _adam_state(optimizer)
    result = {}
    for name, shard in named_parameters(chunk):
        main = shard.to_local().detach().reshape(-1)
        states = {"param": main, **{key: _moment(state, shard, key).reshape(-1) for key in MOMENTS}}
        weight = None if is_loading else main.to(shard.orig_param.dtype)
        result[name] = Owned(_rows_piece(shard, templates[name]), weight, states)
    return result


@dataclass
class MainRows:
    """This rank's rows of one parameter: as a piece of the model tensor, and the main weight's elements there."""

    piece: Piece
    main: torch.Tensor  # flat, the DTensor's local tensor: writing it changes the main weight
    dtype: torch.dtype  # the model's (what a checkpoint's model tensors are saved in)


def main_rows(chunk, templates: dict[str, Any]) -> dict[str, MainRows]:
    """Per parameter name: this rank's rows of its main weight (collective over each parameter's DP group),
    for reading model weights into them without any optimizer state (``checkpoint.pretrained``)."""
    return {
        name: MainRows(
            _rows_piece(shard, templates[name]), shard.to_local().detach().reshape(-1), shard.orig_param.dtype
        )
        for name, shard in named_parameters(chunk)
    }


def _rows_piece(shard, template) -> Piece:
    """The rows of the TP-local parameter that this rank's shard holds, as a piece of the model tensor."""
    shape = tuple(tp_local_shape(shard))
    first, rows, replicated = row_range(shard)
    row = math.prod(shape[1:])
    replica = template.replica_id if replicated else replica_on_every_shard(template)
    return Piece(template, shape, first * row, rows * row, replica)


def _moment(state: dict, shard, key: str) -> torch.Tensor:
    """This rank's rows of an Adam moment; zeros where Adam never stepped the shard (no rows here)."""
    moment = state.get(shard, {}).get(key)  # not state[shard]: a defaultdict would add an empty state
    return to_local_if_dtensor(moment) if moment is not None else torch.zeros_like(shard.to_local())


def _adam_state(optimizer) -> dict:
    inner = optimizer.optimizer
    if not all(k in state for state in inner.state.values() for k in MOMENTS) or not inner.state:
        raise ValueError("Megatron-FSDP checkpoints hold Adam's state: optimizer.optimizer=adam")
    return inner.state


@torch.no_grad()
def load_optimizer(model, optimizer, chunks_owned: list[dict[str, Owned]], loaded: dict[str, Any]) -> None:
    """Main weights, moments and step from the loaded pieces (the request's tensors were this rank's
    main-weight rows and moments themselves, so this mostly checks and sets ``step``)."""
    state = _adam_state(optimizer)
    step = loaded["optimizer"]["param_groups"][0]["step"]  # learning rates: the scheduler's state
    for chunk, chunk_owned in zip(model, chunks_owned):
        for _, shard in named_parameters(chunk):
            if shard.to_local().numel():
                state[shard]["step"] = torch.tensor(float(step))
            else:  # as in an uninterrupted run: Adam never steps a shard without rows, so it has no state
                state.pop(shard, None)
        for parts in chunk_owned.values():
            for name, tensors in loaded.get("param_state", {}).get(parts.key, {}).items():
                parts.piece.fill(parts.states[name], tensors)
    if optimizer.grad_scaler is not None and "grad_scaler" in loaded:
        optimizer.grad_scaler.load_state_dict(loaded["grad_scaler"])
