"""Named speed experiments: each patches dfm for one rung, so its effect is measured side by side.

A variant is either the *old* behaviour of an optimisation that has landed (to show what it
bought) or a candidate not yet landed (to show what it would buy). Each is undone after its rung.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch


@contextlib.contextmanager
def _patched(module, name: str, value) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def flex_mask_per_call() -> contextlib.AbstractContextManager:
    """Before the landed cache: build the FlexAttention block mask in every attention call."""
    from dfm.models.attention import flex

    cached = flex.document_block_mask

    def uncached(params, sq, sk, device):
        params.cache.pop("flex_mask", None)
        return cached(params, sq, sk, device)

    return _patched(flex, "document_block_mask", uncached)


def rows_index_add() -> contextlib.AbstractContextManager:
    """Candidate check of the landed row ops: token grads summed into their per-sample modulation rows
    by ``index_add_`` on CUDA too (the CPU's choice) instead of the one-hot GEMM (``adaln.py``,
    ``row_modulation.py``: ``sum_rows_by_one_hot_gemm``). On CUDA the GEMM avoids ``index_add_``'s
    atomics on a handful of rows; this pair says what that buys. A no-op on the CPU."""
    from dfm.models.common import adaln, row_modulation

    stack = contextlib.ExitStack()
    for module in (adaln, row_modulation):
        stack.enter_context(_patched(module, "sum_rows_by_one_hot_gemm", adaln.sum_rows_by_index_add))
    return stack


def _uniform_segments_sdpa(fast_kernels_only: bool) -> contextlib.AbstractContextManager:
    """A pack whose segments are all one length with no padding (one 8k video, 64 same-size
    images) runs as one batched SDPA call instead of FlexAttention. The lengths are read from the
    pack's host segments (no sync) and cached on the params like the block mask.
    ``fast_kernels_only``: q/k/v made contiguous ``[N, heads, s, d]`` and SDPA limited to cuDNN /
    flash, so it cannot fall back to the math or mem-efficient kernel unnoticed (it raises)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from dfm.data.packed_batch import segment_lengths
    from dfm.models import attention as packed_attention

    flex = packed_attention.flex_document_attention

    def uniform_length(params, side: str, total: int):
        key = f"_dfm_uniform_{side}"
        if not hasattr(params, key):
            host = packed_attention.host_segments(params)
            real, padded = getattr(host, f"cu_seqlens_{side}"), getattr(host, f"cu_seqlens_{side}_padded")
            lengths = segment_lengths(real).tolist()
            same = len(set(lengths)) == 1 and (padded is None or torch.equal(padded, real)) and sum(lengths) == total
            setattr(params, key, lengths[0] if same else None)
        return getattr(params, key)

    def attention(query, key, value, params, scale):
        nq, nk = uniform_length(params, "q", query.shape[0]), uniform_length(params, "kv", key.shape[0])
        if nq is None or nk is None:
            return flex(query, key, value, params, scale)
        heads, dim = query.shape[2], query.shape[3]
        q = query.reshape(-1, nq, heads, dim).transpose(1, 2)
        k, v = (t.reshape(-1, nk, heads, dim).transpose(1, 2) for t in (key, value))
        if not fast_kernels_only:
            return F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(1, 2).reshape(query.shape)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
            out = F.scaled_dot_product_attention(q.contiguous(), k.contiguous(), v.contiguous(), scale=scale)
        return out.transpose(1, 2).reshape(query.shape)

    return _patched(packed_attention, "flex_document_attention", attention)


def uniform_segments_sdpa() -> contextlib.AbstractContextManager:
    """Candidate: uniform packs as one batched SDPA call, SDPA's own kernel choice."""
    return _uniform_segments_sdpa(fast_kernels_only=False)


def uniform_segments_cudnn() -> contextlib.AbstractContextManager:
    """Candidate: the same with contiguous q/k/v and only cuDNN / flash allowed (the measured
    1.01x of ``uniform_segments_sdpa`` suggests SDPA did not pick cuDNN on strided views)."""
    return _uniform_segments_sdpa(fast_kernels_only=True)


VARIANTS: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "default": contextlib.nullcontext,
    "flex_mask_per_call": flex_mask_per_call,
    "rows_index_add": rows_index_add,
    "uniform_segments_sdpa": uniform_segments_sdpa,
    "uniform_segments_cudnn": uniform_segments_cudnn,
}


def apply_variant(name: str) -> contextlib.AbstractContextManager:
    if name not in VARIANTS:
        raise SystemExit(f"unknown variant {name!r}; valid: {sorted(VARIANTS)}")
    return VARIANTS[name]()
