"""A pack's attention segments: ``PackedSegments`` (megatron's ``PackedSeqParams`` plus a token
order, a context-parallel strategy, host copies and per-pack caches) and the helpers every
backend reads them with.

ST-DiT's temporal segments are contiguous only after a permutation (``token_order``); the CP
strategy is context_parallel.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

from dfm.data.packed_batch import segment_lengths


@dataclass
class PackedSegments(PackedSeqParams):
    """Segments of a pack, plus how q/k/v reach them."""

    # (to_segment_order [S], to_token_order [S]): q/k/v rows are permuted so the segments are
    # contiguous, and the output permuted back. None: token order.
    token_order: tuple[Tensor, Tensor] | None = None
    # Callable (kernel, q, k, v) -> out when the pack is split over CP ranks (context_parallel.py).
    context_parallel: Any = None
    # The same segments as host tensors, for loops over segments without a device sync.
    host: PackedSeqParams | None = None
    # Per-pack values the kernels build once (block mask, varlen offsets): name -> (key, value).
    cache: dict[str, tuple[tuple, Any]] = field(default_factory=dict, repr=False)


def host_segments(params: PackedSeqParams) -> PackedSeqParams:
    """``params`` with host cu_seqlens: its ``host`` copy when it has one (reading the device
    tensors instead costs a sync)."""
    host = getattr(params, "host", None)
    return params if host is None else host


def attend_in_segment_order(kernel, query: Tensor, key: Tensor, value: Tensor, params: PackedSeqParams, **kw) -> Tensor:
    """``kernel(q, k, v, params, **kw)`` with rows put into ``params.token_order`` and back."""
    order = getattr(params, "token_order", None)
    if order is None:
        return kernel(query, key, value, params, **kw)
    to_segments, to_tokens = order
    return kernel(query[to_segments], key[to_segments], value[to_segments], params, **kw)[to_tokens]


def segment_bounds(params: PackedSeqParams, side: str) -> tuple[list[int], list[int]]:
    """(starts, lengths) of each sample's real tokens on the 'q' or 'kv' side."""
    params = host_segments(params)
    real = getattr(params, f"cu_seqlens_{side}").tolist()  # Python ints first: one call, not a tensor op each
    padded = getattr(params, f"cu_seqlens_{side}_padded")
    offsets = padded.tolist() if padded is not None else real
    return offsets[:-1], differences(real)


def segment_rooms(params: PackedSeqParams, side: str) -> list[int]:
    """Rows each sample owns on the 'q' or 'kv' side: its padded length (its real one when unpadded)."""
    params = host_segments(params)
    padded = getattr(params, f"cu_seqlens_{side}_padded")
    return differences((padded if padded is not None else getattr(params, f"cu_seqlens_{side}")).tolist())


def differences(offsets: list[int]) -> list[int]:
    """[N+1] cumulative offsets -> [N] lengths."""
    return [end - start for start, end in zip(offsets, offsets[1:])]


def document_ids_on_device(params: PackedSeqParams, side: str, total: int, device: torch.device) -> Tensor:
    """[total] long: sample index of each real token, -1 on padding; from the cu_seqlens tensors,
    vectorised, with no host sync."""
    real = getattr(params, f"cu_seqlens_{side}").to(device)
    padded = getattr(params, f"cu_seqlens_{side}_padded")
    padded = real if padded is None else padded.to(device)
    positions = torch.arange(total, device=device)
    ids = torch.searchsorted(padded[1:].contiguous(), positions, right=True).clamp(max=len(real) - 2)
    lengths = segment_lengths(real)[ids]
    return torch.where(positions - padded[ids] < lengths, ids, -1)


def cached_per_pack(params: PackedSeqParams, name: str, key: tuple, build):
    """``build()`` once per pack, kept in ``params.cache`` under ``name`` while ``key`` matches.

    The model hands every layer the same ``params`` object, so caching there turns one build
    per attention call into one per forward (measured: docs/performance.md). Plain megatron
    ``PackedSeqParams`` (tests) are not ours to extend: built every call.
    """
    if not isinstance(params, PackedSegments):
        return build()
    cached = params.cache.get(name)
    if cached is not None and cached[0] == key:
        return cached[1]
    value = build()
    params.cache[name] = (key, value)
    return value


def query_is_real(params: PackedSeqParams, q_total: int, device: torch.device) -> Tensor:
    """[q_total, 1, 1, 1] bool: the query token is a sample's, not padding."""
    return cached_per_pack(
        params,
        "q_valid",
        (q_total, device),
        lambda: (document_ids_on_device(params, "q", q_total, device) >= 0)[:, None, None, None],
    )
