"""Choosing which samples share a pack: first-fit decreasing over a buffer of sample lengths."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dfm.data.packed_batch import PackedBatch


@dataclass
class PackPlan:
    packs: list[list[int]]  # indices into the buffer; each pack sorted by index
    too_long: list[int]  # indices of samples that alone exceed the capacity (skipped)


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> PackPlan:
    """Group buffer indices so each group's real length is <= capacity; no sample is ever split.

    Longest first (ties by index, so the plan is deterministic), each into the first pack with room.
    Real lengths only: the layout's padding is added afterwards (``pack_samples``) and may take a
    pack past ``capacity``, so that the grouping never depends on the parallel layout.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    packs: list[list[int]] = []
    room: list[int] = []
    too_long: list[int] = []
    for i in order:
        if lengths[i] > capacity:
            too_long.append(i)
            continue
        target = next((p for p, free in enumerate(room) if free >= lengths[i]), None)
        if target is None:
            packs.append([i])
            room.append(capacity - lengths[i])
        else:
            packs[target].append(i)
            room[target] -= lengths[i]
    return PackPlan(packs=[sorted(p) for p in packs], too_long=sorted(too_long))


def packing_efficiency(batches: Iterable[PackedBatch], seq_length: int | None = None) -> float:
    """Real tokens / all tokens. With ``seq_length``, all tokens = packs * seq_length (capacity);
    otherwise the packs' own padded lengths."""
    real = total = 0
    for batch in batches:
        real += batch.num_real_tokens()
        total += seq_length if seq_length is not None else batch.seq_len
    if total == 0:
        raise ValueError("packing_efficiency needs at least one non-empty pack")
    return real / total
