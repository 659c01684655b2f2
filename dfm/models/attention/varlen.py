"""Packed attention through torch's variable-length flash kernel (``torch.nn.attention.varlen``, CUDA).

The kernel takes one ``cu_seqlens`` per side and no separate padded offsets, while our packs may
hold layout padding after each sample (for TP/SP/CP). Copying the real tokens into a dense tensor
would cost a gather and a scatter per call; instead the padding becomes segments of its own:

* queries: sample i's segment spans its real tokens and its padding; padding queries attend to the
  sample's real keys (finite values) and are zeroed afterwards, as the per-segment reference does;
* keys: sample i's segment spans only its real keys; each run of key padding is a segment paired
  with an empty query segment, so no query ever sees it.

Boundaries are built on the host from the pack's host copy (no device sync) and cached on the
params object, which every layer of a forward shares.

A pack whose segments all have one length on each side (one 8k video, 64 same-size images: no key
padding) runs as one batched SDPA call instead, as a plain PyTorch DiT would: on Hopper SDPA picks
cuDNN's flash kernels, whose backward took half the varlen (FlashAttention-2) backward's time at 8k
tokens (H200, 2026-11-29, docs/performance.md).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

from dfm.models.attention.segments import cached_per_pack, differences, query_is_real, segment_bounds


@dataclass(frozen=True)
class VarlenSegments:
    """Cumulative segment boundaries for the kernel (int32, on the compute device) and the longest segments."""

    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int
    uniform: bool = False  # every query segment one length, every key segment one length, none empty


def varlen_boundaries(
    q_starts: list[int], q_total: int, k_starts: list[int], k_lengths: list[int], k_total: int
) -> tuple[list[int], list[int]]:
    """(cu_q, cu_k) host lists tiling [0, q_total) and [0, k_total) with equally many segments.

    ``q_starts``: where each sample's queries begin (its padded offset); ``k_starts``/``k_lengths``:
    each sample's real keys. Key padding (before, between or after samples) gets an empty query segment.
    """
    if q_starts and q_starts[0] != 0:
        raise ValueError(f"packed queries must start at token 0, got {q_starts[0]}")
    cu_q, cu_k = [0], [0]

    def key_gap(end: int) -> None:
        if end > cu_k[-1]:
            cu_q.append(cu_q[-1])
            cu_k.append(end)

    q_ends = [*q_starts[1:], q_total]
    for q_end, k_start, k_length in zip(q_ends, k_starts, k_lengths):
        key_gap(k_start)
        cu_q.append(q_end)
        cu_k.append(k_start + k_length)
    key_gap(k_total)
    return cu_q, cu_k


def varlen_segments(params: PackedSeqParams, q_total: int, k_total: int, device: torch.device) -> VarlenSegments:
    """The kernel's boundaries for this pack, built once per pack and kept on ``params``."""

    def build() -> VarlenSegments:
        q_starts, _ = segment_bounds(params, "q")
        k_starts, k_lengths = segment_bounds(params, "kv")
        cu_q, cu_k = varlen_boundaries(q_starts, q_total, k_starts, k_lengths, k_total)
        q_sizes, k_sizes = (set(differences(cu)) for cu in (cu_q, cu_k))  # distinct segment sizes
        return VarlenSegments(
            cu_q=torch.tensor(cu_q, dtype=torch.int32).to(device, non_blocking=True),
            cu_k=torch.tensor(cu_k, dtype=torch.int32).to(device, non_blocking=True),
            max_q=max(q_sizes),
            max_k=max(k_sizes),
            uniform=len(q_sizes) == len(k_sizes) == 1 and 0 not in q_sizes | k_sizes,
        )

    return cached_per_pack(params, "varlen", (q_total, k_total, device), build)


def torch_varlen_attn(query: Tensor, key: Tensor, value: Tensor, segments: VarlenSegments, scale: float) -> Tensor:
    """torch's kernel over ``segments``; imported late so CPU-only installs without it still import this module.

    Older torch releases take no ``scale``: there only the default 1/sqrt(head dim) is possible.
    The flash kernel takes head dims in multiples of 8 only (SDPA pads others before calling it):
    others are zero-padded here, which adds nothing to q.k, and the padded output channels dropped.
    """
    from torch.nn.attention.varlen import varlen_attn

    head_dim = query.shape[-1]
    if head_dim % 8:
        padded = (F.pad(t, (0, -head_dim % 8)) for t in (query, key, value))
        return torch_varlen_attn(*padded, segments, scale)[..., :head_dim]

    cu_q, cu_k, max_q, max_k = segments.cu_q, segments.cu_k, segments.max_q, segments.max_k
    if "scale" in inspect.signature(varlen_attn).parameters:
        return varlen_attn(query, key, value, cu_q, cu_k, max_q, max_k, scale=scale)
    if not math.isclose(scale, query.shape[-1] ** -0.5):
        raise ValueError(f"this torch's varlen_attn has no scale argument; softmax scale {scale} is not the default")
    return varlen_attn(query, key, value, cu_q, cu_k, max_q, max_k)


def batched_sdpa(query: Tensor, key: Tensor, value: Tensor, segments: VarlenSegments, scale: float) -> Tensor:
    """The kernel for uniform ``segments``: q [t, np, hn] as [N, np, s, hn] (views), one SDPA call, SDPA's
    own kernel choice (it pads head dims itself) -> [t, np, hn]."""
    n = segments.cu_q.numel() - 1
    q, k, v = (t.view(n, -1, *t.shape[1:]).transpose(1, 2) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2).reshape(query.shape)


def varlen_available(device: torch.device | str) -> bool:
    """Whether this torch has the variable-length flash kernel and ``device`` is a CUDA device to run it.

    The device first: torch's varlen module imports dynamo (~2 s of CPU), which a CPU rank never needs."""
    if torch.device(device).type != "cuda":
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def varlen_document_attention(
    query: Tensor, key: Tensor, value: Tensor, params: PackedSeqParams, scale: float, attn=None
) -> Tensor:
    """query [sq, 1, np, hn], key/value [sk, 1, np, hn] -> [sq, 1, np, hn]; padding rows are 0.

    ``attn(q [t, np, hn], k, v, segments, scale)`` is the kernel: by default ``batched_sdpa`` for a
    uniform pack, else torch's varlen kernel (tests pass a reference with the same contract where CUDA
    is missing).
    """
    if query.shape[1] != 1:
        raise ValueError(f"packed attention expects one pack per micro-batch (b == 1), got b = {query.shape[1]}")
    segments = varlen_segments(params, query.shape[0], key.shape[0], query.device)
    attn = attn or (batched_sdpa if segments.uniform else torch_varlen_attn)
    q, k, v = (t.squeeze(1) for t in (query, key, value))
    out = attn(q, k, v, segments, scale).unsqueeze(1)
    return out * query_is_real(params, query.shape[0], query.device).to(out.dtype)
