"""Checkpoint state of the distributed optimizer: each data-parallel rank writes and reads the flat
range of every parameter it updates (``dfm.checkpoint.pieces``): the model weight's elements there,
the fp32 main weight and Adam's moments, under the keys of megatron's ``fully_reshardable`` format
(``optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>``), which Megatron-FSDP uses too
(``fsdp_state.py``). Nothing is gathered: megatron's sharded formats either gather the whole state
to a rank (``fully_reshardable``) or only reshard over DP (``dp_reshardable``).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

from dfm.checkpoint.pieces import STATE_NAMES, Owned, Piece, replica_on_every_shard, without_empty

SHARDING_TYPE = "dfm_owned_pieces"  # recorded next to the optimizer's common state


def optimizers(optimizer) -> list:
    """The distributed optimizers inside megatron's (chained) optimizer."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def is_distributed(optimizer) -> bool:
    return all(hasattr(inner, "gbuf_ranges") for inner in optimizers(optimizer))


def owned(optimizer, model_states: list[dict[str, Any]]) -> list[list[tuple[torch.nn.Parameter, Owned]]]:
    """Per distributed optimizer: (model parameter, what this rank holds of it) for every parameter
    this rank updates, in the optimizer's order."""
    templates = {
        id(sharded.data): sharded
        for state in model_states
        for sharded in state.values()
        if isinstance(sharded, ShardedTensor | ShardedTensorFactory)
    }
    result = []
    for inner in optimizers(optimizer):
        instance = getattr(inner, "distributed_optimizer_instance_id", 0)
        parts = []
        for model_param, param_range in _param_ranges(inner):
            template = templates[id(model_param)]
            piece = Piece(
                template,
                tuple(model_param.shape),
                param_range.start,
                param_range.size,
                replica_on_every_shard(template, instance),
            )
            weight = model_param.detach().view(-1)[param_range.start : param_range.end]
            states = inner.param_states(model_param)  # a compat patch (dfm/platform/compat/checkpointing.py)
            parts.append(
                (model_param, Owned(piece, weight, {name: states[name].detach().view(-1) for name in STATE_NAMES}))
            )
        result.append(parts)
    return result


def _param_ranges(inner):
    """(model parameter, its range in this rank's shard), in the order megatron's formats use."""
    for gbuf_range_maps in inner.gbuf_ranges:
        for gbuf_range_map_for_all_buckets in gbuf_range_maps.values():
            for gbuf_range_map in gbuf_range_map_for_all_buckets:
                for model_param, range_map in gbuf_range_map["param_map"].items():
                    yield model_param, range_map["param"]


def in_buffers(optimizer) -> set[int]:
    """ids of the parameters some distributed optimizer updates, on this rank or another."""
    return {
        id(param) for inner in optimizers(optimizer) for buffer in inner.buffers for param in buffer.param_index_map
    }


def optimizer_state(optimizer, parts: list[list[tuple[Any, Owned]]], is_loading: bool) -> dict[str, Any]:
    """The common state (param groups, step, grad scaler) and per parameter its pieces; to load, into
    new flat tensors (``load_optimizer`` hands them to megatron)."""
    states = []
    for inner, inner_parts in zip(optimizers(optimizer), parts):
        if is_loading:
            for _, part in inner_parts:
                part.states = {name: torch.empty(part.piece.numel, dtype=torch.float32) for name in STATE_NAMES}
        param_state = without_empty({part.key: without_empty(part.optimizer_sharded()) for _, part in inner_parts})
        states.append({**inner.state_dict(), "param_state": param_state, "param_state_sharding_type": SHARDING_TYPE})
    if len(states) == 1:
        return states[0]
    for index, state in enumerate(states):  # megatron's chained format: keys prefixed per optimizer
        for sharded in _sharded_values(state["param_state"]):
            sharded.key = f"chained_{index}.{sharded.key}"
    return dict(enumerate(states))


def _sharded_values(param_state: dict) -> list[ShardedTensor]:
    return [sharded for tensors in param_state.values() for pieces in tensors.values() for sharded in pieces]


@torch.no_grad()
def load_optimizer(optimizer, parts: list[list[tuple[Any, Owned]]], loaded: dict[str, Any]) -> None:
    """Param groups, step and grad scaler through megatron; each parameter's main weight and moments
    from the loaded pieces."""
    inners = optimizers(optimizer)
    states = [loaded] if len(inners) == 1 else [loaded[index] for index in range(len(inners))]
    for inner, inner_parts, state in zip(inners, parts, states):
        inner.load_state_dict({k: v for k, v in state.items() if k not in ("param_state", "param_state_sharding_type")})
        for model_param, part in inner_parts:
            for name, tensors in state.get("param_state", {}).get(part.key, {}).items():
                part.piece.fill(part.states[name], tensors)
            inner.set_param_states(model_param, part.states)
