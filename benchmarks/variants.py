"""Named speed experiments: each patches dfm for one rung, so its effect is measured side by side.

A variant is either the *old* behaviour of an optimisation that has landed (to show what it
bought) or a candidate not yet landed (to show what it would buy). Each is undone after its rung.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

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
    from dfm.models.common import packed_attention

    cached = packed_attention.document_block_mask

    def uncached(params, sq, sk, device):
        params._dfm_flex_mask = None
        return cached(params, sq, sk, device)

    return _patched(packed_attention, "document_block_mask", uncached)


def compiled_modulate() -> contextlib.AbstractContextManager:
    """Candidate: fuse adaLN's x * (1 + scale) + shift into one kernel with torch.compile."""
    from dfm.models.dit import dit_layer

    return _patched(dit_layer, "modulate", torch.compile(dit_layer.modulate, dynamic=True))


def adaln_matmul_broadcast() -> contextlib.AbstractContextManager:
    """Candidate: per-sample modulation -> per-token rows by a one-hot matmul instead of a gather.

    A gather's backward scatters thousands of token rows into a handful of sample rows
    (atomics on a few addresses); the one-hot matmul's backward is a plain matmul.
    """
    from dfm.models.common import adaln

    def forward(self, cond, token_sample_ids):
        per_sample, _ = self.linear(torch.nn.functional.silu(cond))
        samples = torch.arange(per_sample.shape[0], device=per_sample.device)
        one_hot = (token_sample_ids[:, None] == samples[None]).to(per_sample.dtype)
        return (one_hot @ per_sample).unsqueeze(1).chunk(self.num_chunks, dim=-1)

    return _patched(adaln.AdaLNModulation, "forward", forward)


def adaln_gather_backward() -> contextlib.AbstractContextManager:
    """Before the landed ``rows_to_tokens``: per-sample adaLN rows reach tokens by plain indexing,
    whose backward scatters every token's grad into its sample's row (serialised on CUDA)."""
    from dfm.models.common import adaln
    from dfm.models.dit import dit_model

    def gather(rows, token_row_ids):
        return rows[token_row_ids]

    stack = contextlib.ExitStack()
    stack.enter_context(_patched(adaln, "rows_to_tokens", gather))
    stack.enter_context(_patched(dit_model, "rows_to_tokens", gather))
    return stack


def uniform_segments_sdpa() -> contextlib.AbstractContextManager:
    """Candidate: a pack whose segments are all one length with no padding (one 8k video, 64
    same-size images) runs as one batched SDPA call (cuDNN/flash) instead of FlexAttention.
    Costs one host sync per pack and attention side, cached on the params like the block mask."""
    import torch.nn.functional as F

    from dfm.models.common import packed_attention

    flex = packed_attention.flex_document_attention

    def uniform_length(params, side: str, total: int):
        key = f"_dfm_uniform_{side}"
        if not hasattr(params, key):
            real = getattr(params, f"cu_seqlens_{side}")
            padded = getattr(params, f"cu_seqlens_{side}_padded")
            lengths = (real[1:] - real[:-1]).tolist()
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
        out = F.scaled_dot_product_attention(q, k, v, scale=scale)
        return out.transpose(1, 2).reshape(query.shape)

    return _patched(packed_attention, "flex_document_attention", attention)


VARIANTS: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "default": contextlib.nullcontext,
    "flex_mask_per_call": flex_mask_per_call,
    "compiled_modulate": compiled_modulate,
    "adaln_matmul_broadcast": adaln_matmul_broadcast,
    "adaln_gather_backward": adaln_gather_backward,
    "uniform_segments_sdpa": uniform_segments_sdpa,
}


def apply_variant(name: str) -> contextlib.AbstractContextManager:
    if name not in VARIANTS:
        raise SystemExit(f"unknown variant {name!r}; valid: {sorted(VARIANTS)}")
    return VARIANTS[name]()
