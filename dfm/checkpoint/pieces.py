"""The piece of a tensor one rank owns, written and read as its own sharded tensors.

The distributed optimizer owns a flat range of each TP-local parameter (and of its main weight and
Adam moments), Megatron-FSDP whole rows of it, which is a flat range too. A flat range of a
row-major tensor is at most ``2 * ndim - 1`` boxes; each box, placed at its global offset, is one
of megatron's irregular ``ShardedTensor`` (no regular grid), so every rank writes exactly what it
holds and reads exactly what it needs: torch.distributed.checkpoint reads any box of a tensor
whatever boxes it was written in (other ranges, rows, or whole TP-local tensors of older saves).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

Box = tuple[tuple[int, int], ...]  # per dimension [start, stop)


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[int, Box]]:
    """Elements ``[start, stop)`` of a row-major tensor of ``shape`` as boxes, each with the flat
    index of its first element. Every box is contiguous in the flattening."""
    if start >= stop:
        return []
    if not shape:
        return [(0, ())]
    inner = math.prod(shape[1:])
    first, first_rest = divmod(start, inner)
    last, last_rest = divmod(stop, inner)

    def within_row(row: int, lo: int, hi: int) -> list[tuple[int, Box]]:
        return [(row * inner + at, ((row, row + 1), *box)) for at, box in flat_range_boxes(shape[1:], lo, hi)]

    if first == last:
        return within_row(first, first_rest, last_rest)
    boxes = []
    if first_rest:
        boxes += within_row(first, first_rest, inner)
        first += 1
    if last > first:
        boxes.append((first * inner, ((first, last), *((0, n) for n in shape[1:]))))
    if last_rest:
        boxes += within_row(last, 0, last_rest)
    return boxes


def _region_in(base: torch.Tensor, view: torch.Tensor) -> Box:
    """Where ``view`` (a sub-box of the contiguous ``base``, e.g. from ``torch.chunk``) lies in it."""
    offset, starts = view.storage_offset() - base.storage_offset(), []
    for stride in base.stride():
        index, offset = divmod(offset, stride)
        starts.append(index)
    return tuple((begin, begin + size) for begin, size in zip(starts, view.shape))


def _global_parts(template: ShardedTensor | ShardedTensorFactory, key: str, shape) -> list[tuple[Box, ShardedTensor]]:
    """The TP-local regions of a model tensor and the global tensor (renamed ``key``) each is part of:
    one for a plain tensor, one per built tensor for a factory (FLUX's strided shards, GLU halves)."""
    if isinstance(template, ShardedTensorFactory):
        base = torch.empty(shape, device="meta")
        built = template.build_fn(key, base, template.replica_id, None)
        built = built if isinstance(built, list) else [built]
        return [(_region_in(base, part.data), part) for part in built]
    return [(tuple((0, n) for n in shape), dataclasses.replace(template, key=key, data=None))]


def _intersect(a: Box, b: Box) -> Box | None:
    box = tuple((max(lo_a, lo_b), min(hi_a, hi_b)) for (lo_a, hi_a), (lo_b, hi_b) in zip(a, b))
    return box if all(lo < hi for lo, hi in box) else None


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, start + numel)`` of the flattened TP-local tensor of ``shape`` that a rank
    holds, of the model tensor ``template`` (global key and TP placement). ``replica_id``: the
    piece's replica (0 on the rank that writes it)."""

    template: Any  # ShardedTensor | ShardedTensorFactory
    shape: tuple[int, ...]
    start: int
    numel: int
    replica_id: Any

    def _parts(self, key: str, flat: torch.Tensor) -> Iterator[tuple[ShardedTensor, tuple[int, ...], torch.Tensor]]:
        """(global tensor, global offset, view of ``flat``) of each box of the piece."""
        if flat.numel() != self.numel:
            raise ValueError(f"{key}: {flat.numel()} elements given for a piece of {self.numel}")
        for first, box in flat_range_boxes(self.shape, self.start, self.start + self.numel):
            size = math.prod(hi - lo for lo, hi in box)
            view = flat[first - self.start : first - self.start + size].view([hi - lo for lo, hi in box])
            for region, part in _global_parts(self.template, key, self.shape):
                common = _intersect(box, region)
                if common is None:
                    continue
                sub = view[tuple(slice(lo - b, hi - b) for (lo, hi), (b, _) in zip(common, box))]
                prepend = part.prepend_axis_num
                offset = tuple(g + lo - r for g, (lo, _), (r, _) in zip(part.global_offset[prepend:], common, region))
                yield part, (*part.global_offset[:prepend], *offset), sub.reshape((1,) * prepend + sub.shape)

    def sharded(self, key: str, flat: torch.Tensor) -> list[ShardedTensor]:
        """``flat`` (this piece's elements) as sharded tensors named ``key`` (a factory's parts may
        rename it). On the host they keep sharing ``flat``'s memory (see ``_exact_storage``)."""
        return [
            ShardedTensor(
                key=part.key,
                data=_exact_storage(data),
                dtype=data.dtype,
                local_shape=tuple(data.shape),
                global_shape=part.global_shape,
                global_offset=offset,
                axis_fragmentations=None,  # irregular: any box at any offset
                replica_id=self.replica_id,
            )
            for part, offset, data in self._parts(key, flat)
        ]

    @torch.no_grad()
    def fill(self, flat: torch.Tensor, loaded: list[torch.Tensor]) -> None:
        """Copy what ``dist_checkpointing.load`` returned for ``sharded(key, flat)`` into ``flat``
        (a no-op where it loaded in place)."""
        parts = list(self._parts("", flat))
        if len(parts) != len(loaded):
            raise ValueError(f"{len(loaded)} tensors loaded for a piece of {len(parts)} boxes")
        for (_, _, view), tensor in zip(parts, loaded):
            if view.data_ptr() != tensor.data_ptr():
                view.copy_(tensor.reshape(view.shape))


def _exact_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, as a tensor whose storage is exactly its bytes. megatron's writer clones
    every host tensor whose storage is larger than the tensor (a view of a bucket, of a flat
    range...) before writing: for pieces of parameter buffers that would copy the rank's whole shard."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.numel() == 0:
        return tensor if tensor.is_contiguous() else tensor.contiguous()
    raw = torch.from_numpy(tensor.detach().reshape(-1).view(torch.uint8).numpy())
    return raw.view(tensor.dtype).view(tensor.shape)


def replica_on_every_shard(template, instance: int = 0) -> tuple[int, ...] | int:
    """A model tensor's replica id with its data-parallel part (the last) set to ``instance``: every
    data-parallel rank writes its own piece, so none is a replica of another's."""
    replica = template.replica_id
    return (*replica[:-1], instance) if isinstance(replica, tuple) else instance


MOMENTS = ("exp_avg", "exp_avg_sq")
# Optimizer tensors per parameter, under ``optimizer.state.<name>.<model key>``: the names megatron's
# ``fully_reshardable`` format uses, so checkpoints written in it (before pieces) still load.
STATE_NAMES = ("param", *MOMENTS)


@dataclass
class Owned:
    """What a rank holds of one parameter: its piece, the model weight's elements there (in the
    model's dtype) and the optimizer's flat tensors of the same elements (``STATE_NAMES``)."""

    piece: Piece
    weight: torch.Tensor | None  # unused to load (FSDP: None): the model comes whole or from the main weights
    states: dict[str, torch.Tensor]

    @property
    def key(self) -> str:
        return self.piece.template.key

    def optimizer_sharded(self) -> dict[str, list[ShardedTensor]]:
        return {
            name: self.piece.sharded(f"optimizer.state.{name}.{self.key}", self.states[name]) for name in STATE_NAMES
        }


def without_empty(pieces: dict[str, Any]) -> dict[str, Any]:
    """``pieces`` without the entries of a rank that holds nothing of them: an empty list in a sharded
    state dict would go to the common state, which every rank's own lists then fail to merge with."""
    return {key: value for key, value in pieces.items() if not (isinstance(value, list | dict) and not value)}
