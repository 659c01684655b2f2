"""Choosing which samples share a pack, from a buffer of sample lengths: by tokens or by cost.

``tokens``: first-fit decreasing on real tokens (fullest packs). ``cost``: packs of about equal
training FLOPs (``dfm/data/pack_cost.py``), so that every data-parallel rank and micro-batch does
about the same work. Both use real lengths only and keep ``capacity`` real tokens a hard limit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from dfm.data.pack_cost import PackCost
from dfm.data.packed_batch import PackedBatch

PackingBalance = Literal["cost", "tokens"]
PACKING_BALANCES: tuple[PackingBalance, ...] = ("cost", "tokens")


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


def cost_balanced_packs(lengths: Sequence[int], capacity: int, cost: PackCost) -> PackPlan:
    """Group buffer indices into packs of about equal cost, each <= capacity real tokens.

    Longest processing time first: samples, costliest first, each go to the cheapest of ``k`` packs
    with token room, for the smallest ``k`` from ``ceil(tokens / capacity)`` at which every sample
    finds room (at most as many packs as first-fit decreasing on tokens needs, whose packs are kept
    if none fits). Packs come costliest first: consecutive packs, which go to the DP ranks of one
    micro-batch, then cost alike even where one sample costs more than a pack's share.
    """
    too_long = [i for i, n in enumerate(lengths) if n > capacity]
    costs = [cost.sample(n) for n in lengths]
    order = sorted((i for i, n in enumerate(lengths) if n <= capacity), key=lambda i: (-costs[i], i))
    token_packs = first_fit_decreasing(lengths, capacity).packs
    packs = None
    for num_packs in range(max(1, -(-sum(lengths[i] for i in order) // capacity)), len(token_packs) + 1):
        packs = _level_by_cost(order, lengths, costs, capacity, num_packs)
        if packs is not None:
            break
    packs = [sorted(p) for p in (packs if packs is not None else token_packs)]
    packs.sort(key=lambda p: (-sum(costs[i] for i in p), p[0]))
    return PackPlan(packs=packs, too_long=too_long)


def _level_by_cost(
    order: Sequence[int], lengths: Sequence[int], costs: Sequence[float], capacity: int, num_packs: int
) -> list[list[int]] | None:
    """``order`` dealt over ``num_packs`` packs, each sample to the cheapest with token room; None when one finds none."""
    packs: list[list[int]] = [[] for _ in range(num_packs)]
    tokens = [0] * num_packs
    spent = [0.0] * num_packs
    for i in order:
        open_packs = [p for p in range(num_packs) if tokens[p] + lengths[i] <= capacity]
        if not open_packs:
            return None
        target = min(open_packs, key=lambda p: (spent[p], p))
        packs[target].append(i)
        tokens[target] += lengths[i]
        spent[target] += costs[i]
    return [p for p in packs if p]


def select_packs(lengths: Sequence[int], capacity: int, balance: PackingBalance, cost: PackCost) -> PackPlan:
    """The packs of one buffer under ``balance``."""
    if balance == "cost":
        return cost_balanced_packs(lengths, capacity, cost)
    if balance == "tokens":
        return first_fit_decreasing(lengths, capacity)
    raise ValueError(f"packing balance must be one of {PACKING_BALANCES}, got {balance!r}")


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
