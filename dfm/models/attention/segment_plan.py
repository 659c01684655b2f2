"""A pack's attention segments as a few batched kernel calls: one per distinct query length.

Segments with the same query length form a group, attended as one ``[n, b*np, len, hn]`` call. A
side whose segments are equally long at a regular stride (every clip 32 tokens, back to back) is a
strided view of the pack's rows, no copy; otherwise its rows are gathered by index. Key lengths
that differ within a group (captions) are padded to the group's longest with a -inf mask: read from
each segment's own padding rows when the pack has them (one-shape packs, packing.py), else the
segment's last key repeated. Built once per pack shape from the host segments (``plan_of_shape``)
and kept on ``params`` (every layer gets the same object).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

from dfm.models.attention.segments import cached_per_pack, host_segments, segment_bounds, segment_rooms

Segment = tuple[int, int, int, int]  # (q start, q length, kv start, kv length), lengths > 0


@dataclass
class Rows:
    """One side of a group: ``n`` segments of ``length`` rows each."""

    length: int
    index: Tensor  # [n * length] long, the pack row of each (segment, position)
    strided: tuple[int, int] | None  # (first start, stride): index == first + stride * i + j


@dataclass
class Group:
    q: Rows
    kv: Rows
    mask: Tensor | None  # [n, 1, 1, kv.length] bool, False on keys padded to the group's longest
    members: tuple[int, ...] = ()  # the group's segments: their places in the planned list
    additive: dict = field(default_factory=dict, repr=False)  # dtype -> the mask as 0 / -inf

    def bias(self, dtype: torch.dtype) -> Tensor | None:
        """The mask as the additive bias the CPU flash kernel takes (in the query's dtype), made once."""
        if self.mask is None:
            return None
        if dtype not in self.additive:
            self.additive[dtype] = torch.where(self.mask, 0.0, float("-inf")).to(dtype)
        return self.additive[dtype]


@dataclass
class SegmentPlan:
    groups: list[Group]
    q_covers_all: bool  # every query row is some segment's (no zero rows to write)
    kv_once: bool  # every kv row read by at most one (segment, position): grads copied, not added
    kv_covers_all: bool = False  # every kv row read by some slot: its grad is written, none left to zero


def _rows(starts: list[int], lengths: list[int], device: torch.device, rooms: list[int] | None = None) -> Rows:
    """``rooms``: the rows each segment owns from its start (its padded extent). When the starts are
    regular and every segment owns the longest length, short segments read their own padding rows
    (masked) and the side is a strided view; otherwise padded slots read the segment's last row."""
    length = max(lengths)
    step = starts[1] - starts[0] if len(starts) > 1 else length
    regular = step >= 0 and all(b - a == step for a, b in zip(starts, starts[1:]))
    owned = all(n == length for n in lengths) or (rooms is not None and min(rooms) >= length)
    offsets = torch.arange(length)
    if regular and owned:
        index = torch.tensor(starts)[:, None] + offsets
        return Rows(length, index.flatten().to(device, non_blocking=True), (starts[0], step))
    ends = torch.tensor(lengths)[:, None] - 1
    index = torch.tensor(starts)[:, None] + torch.minimum(offsets, ends)  # padded slots read the last key
    return Rows(length, index.flatten().to(device, non_blocking=True), None)


def plan_segments(
    segments: list[Segment], q_total: int, kv_total: int, device: torch.device, kv_rooms: list[int] | None = None
) -> SegmentPlan:
    """Group ``segments`` (non-empty, disjoint query ranges) by query length; ``kv_rooms``: each
    segment's padded kv extent (the rows it owns), when known (unknown: 0, owning none)."""
    by_length: dict[int, list[tuple[int, Segment, int]]] = {}
    for place, (segment, room) in enumerate(zip(segments, kv_rooms or [0] * len(segments))):
        by_length.setdefault(segment[1], []).append((place, segment, room))
    groups, reads = [], []
    for members in by_length.values():
        q0, nq, k0, nk = (list(column) for column in zip(*(segment for _, segment, _ in members)))
        room = [r for _, _, r in members]
        mask = key_mask(nk, max(nk), device)
        places = tuple(place for place, _, _ in members)
        group = Group(_rows(q0, nq, device), _rows(k0, nk, device, room), mask, places)
        groups.append(group)
        # The kv rows each segment's slots read: its own, unless padded slots re-read its last key.
        repeats = mask is not None and group.kv.strided is None
        reads += [(start, start + (n if repeats else group.kv.length), repeats) for start, n in zip(k0, nk)]
    reads.sort()
    kv_once = not any(r for _, _, r in reads) and all(b[0] >= a[1] for a, b in zip(reads, reads[1:]))
    # Read rows back to back from 0 to the end (a pack's own padding rows included): no kv row without a grad.
    kv_covers_all = kv_once and bool(reads) and reads[0][0] == 0 and reads[-1][1] == kv_total
    kv_covers_all = kv_covers_all and all(b[0] == a[1] for a, b in zip(reads, reads[1:]))
    return SegmentPlan(groups, sum(nq for _, nq, _, _ in segments) == q_total, kv_once, kv_covers_all)


def segment_plan(params: PackedSeqParams, q_total: int, kv_total: int, device: torch.device) -> SegmentPlan | None:
    """The plan of ``params``' non-empty segments (None: there are none), built once per pack shape."""
    host = host_segments(params)
    bounds = tuple(id(getattr(host, f"cu_seqlens_{name}")) for name in ("q", "q_padded", "kv", "kv_padded"))
    # The host tensors are kept with the plan, so their ids stay theirs while it is cached.
    key = (q_total, kv_total, device, bounds)
    held = (host.cu_seqlens_q, host.cu_seqlens_q_padded, host.cu_seqlens_kv, host.cu_seqlens_kv_padded)
    return cached_per_pack(
        params, "segment_plan", key, lambda: (held, plan_of_shape(params, q_total, kv_total, device))
    )[1]


def key_mask(lengths: list[int], length: int, device: torch.device) -> Tensor | None:
    """[n, 1, 1, length] bool, True on each segment's first ``lengths[i]`` keys; None when all are ``length`` long."""
    if all(n == length for n in lengths):
        return None
    mask = (torch.arange(length) < torch.tensor(lengths)[:, None])[:, None, None]
    return mask.to(device, non_blocking=True)


def plan_of_shape(params: PackedSeqParams, q_total: int, kv_total: int, device: torch.device) -> SegmentPlan | None:
    """``segment_plan`` for a pack laid out like ``params``: packs of one shape (a data set of one
    clip size, every step) share one plan, made once (~0.35 ms an attention kind on 64 clips).

    When every key segment has room for the pack's longest (captions padded to the longest), each
    reads its own rows up to that length whatever its real length: the plan is the one of a pack whose
    keys are all that long (shared by every pack laid out alike), with this pack's key mask."""
    q_starts, q_lens = segment_bounds(params, "q")
    kv_starts, kv_lens = segment_bounds(params, "kv")
    rooms = segment_rooms(params, "kv")
    longest = max(kv_lens, default=0)
    own_rows = min(q_lens, default=0) > 0 and min(kv_lens) > 0 and min(rooms) >= longest
    read = (longest,) * len(kv_lens) if own_rows else tuple(kv_lens)
    plan = _plan_of_bounds(
        (tuple(q_starts), tuple(q_lens), tuple(kv_starts), read, tuple(rooms)), q_total, kv_total, device
    )
    return with_key_lengths(plan, kv_lens) if own_rows else plan


def with_key_lengths(plan: SegmentPlan, kv_lengths: list[int]) -> SegmentPlan:
    """``plan`` (every segment planned with all its keys real) with the real key lengths' masks."""
    groups = []
    for group in plan.groups:
        mask = key_mask([kv_lengths[place] for place in group.members], group.kv.length, group.kv.index.device)
        groups.append(group if mask is None else dataclasses.replace(group, mask=mask, additive={}))
    return dataclasses.replace(plan, groups=groups)


@functools.lru_cache(maxsize=64)
def _plan_of_bounds(shape: tuple[tuple[int, ...], ...], q_total: int, kv_total: int, device: torch.device):
    q_starts, q_lens, kv_starts, kv_lens, kv_rooms = shape
    kept = [i for i, (nq, nk) in enumerate(zip(q_lens, kv_lens)) if nq and nk]
    segments = [(q_starts[i], q_lens[i], kv_starts[i], kv_lens[i]) for i in kept]
    rooms = [kv_rooms[i] for i in kept]
    return plan_segments(segments, q_total, kv_total, device, rooms) if segments else None


def merged_heads(x: Tensor) -> Tensor:
    """``x`` [s, b, np, hn] itself when its b and np dims merge into one strided dim, else a copy that does."""
    s0, s1, s2, s3 = x.stride()
    if s3 == 1 and (x.shape[1] == 1 or s1 == x.shape[2] * s2):
        return x
    return x.contiguous()


def gather(x: Tensor, rows: Rows) -> Tensor:
    """[s, b, np, hn] (``merged_heads``) -> [n, b*np, length, hn]: a view when ``rows`` is strided."""
    _, b, heads, hn = x.shape
    n = rows.index.shape[0] // rows.length
    if rows.strided is not None:
        first, step = rows.strided
        s0, _, s2, s3 = x.stride()
        return x.as_strided((n, b * heads, rows.length, hn), (step * s0, s2, s0, s3), x.storage_offset() + first * s0)
    # index_select reads a non-contiguous source element by element: a copy first is ~10x faster (the
    # keys and values of a fused projection, heads interleaved, are such a source).
    return x.contiguous().index_select(0, rows.index).view(n, rows.length, b * heads, hn).transpose(1, 2)


def token_rows(values: Tensor, like: Tensor) -> Tensor:
    """[n, b*np, length, hn] -> [n * length, b, np, hn] rows shaped like ``like``'s."""
    return values.transpose(1, 2).reshape(-1, *like.shape[1:])


def scatter(buffer: Tensor, rows: Rows, values: Tensor, add: bool = False) -> None:
    """Write (``add``: sum) group values [n, b*np, length, hn] into their rows of ``buffer`` [s, b, np, hn]."""
    if add:
        buffer.index_add_(0, rows.index, token_rows(values, buffer))
    elif rows.strided is not None:
        gather(buffer, rows).copy_(values)
    else:
        buffer.index_copy_(0, rows.index, token_rows(values, buffer))


def assemble(like: Tensor, plan: SegmentPlan, side: str, values: list[Tensor], add: bool = False) -> Tensor:
    """One [s, b, np, hn] tensor shaped like ``like`` from the groups' values on ``side``; rows no
    segment has are 0. A single group covering every row in order is a reshape of its values."""
    groups = plan.groups
    if len(groups) == 1 and not add:
        rows = getattr(groups[0], side)
        if rows.strided == (0, rows.length) and rows.index.shape[0] == like.shape[0]:
            return token_rows(values[0], like)
    covered = plan.q_covers_all if side == "q" else plan.kv_covers_all and not add
    buffer = like.new_empty(like.shape) if covered else like.new_zeros(like.shape)
    for group, value in zip(groups, values):
        scatter(buffer, getattr(group, side), value, add)
    return buffer
