"""Named speed experiments: each patches dfm for one rung, so its effect is measured side by side.

A variant is either the *old* behaviour of an optimisation that has landed (to show what it
bought) or a candidate not yet landed (to show what it would buy). Each is undone after its rung.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


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


def uniform_packs_varlen() -> contextlib.AbstractContextManager:
    """Before the landed batched call (H200, 2026-11-29): uniform packs through torch's varlen kernel like
    any other, instead of one batched SDPA call (cuDNN's kernels on Hopper)."""
    from dfm.models.attention import varlen

    return _patched(varlen, "batched_sdpa", varlen.torch_varlen_attn)


VARIANTS: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "default": contextlib.nullcontext,
    "flex_mask_per_call": flex_mask_per_call,
    "rows_index_add": rows_index_add,
    "uniform_packs_varlen": uniform_packs_varlen,
}


def apply_variant(name: str) -> contextlib.AbstractContextManager:
    if name not in VARIANTS:
        raise SystemExit(f"unknown variant {name!r}; valid: {sorted(VARIANTS)}")
    return VARIANTS[name]()
