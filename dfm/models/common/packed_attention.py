"""Core attention over THD-packed sequences: no token attends across samples.

Plugs into megatron-core's ``SelfAttention`` / ``CrossAttention`` as the ``core_attention``
submodule. We keep megatron's ``sbhd`` tensor layout (b == 1 for a pack) and read the sample
boundaries from ``PackedSeqParams``, so per-token 3D RoPE is applied by megatron unchanged.

Backends (all must agree; tests prove it):
  * ``sdpa``: torch SDPA on each sample's segment, the reference.
  * ``flex``: torch FlexAttention with a document block mask, one kernel per pack.
  * ``varlen``: torch's variable-length flash kernel, one call per pack (CUDA; varlen_attention.py).

``PackedSegments`` extends the params with a token order (ST-DiT's temporal segments are
contiguous only after a permutation) and a context-parallel strategy (context_parallel.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from dfm.data.packed_batch import segment_lengths

BACKENDS = ("sdpa", "flex", "varlen")


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
    real = getattr(params, f"cu_seqlens_{side}")
    padded = getattr(params, f"cu_seqlens_{side}_padded")
    offsets = padded if padded is not None else real
    return offsets[:-1].tolist(), segment_lengths(real).tolist()


def sdpa_per_segment(query: Tensor, key: Tensor, value: Tensor, params: PackedSeqParams, scale: float) -> Tensor:
    """query [sq, b, np, hn], key/value [sk, b, np, hn] -> [sq, b, np, hn]; padding rows are 0."""
    out = torch.zeros_like(query)
    q_starts, q_lens = segment_bounds(params, "q")
    kv_starts, kv_lens = segment_bounds(params, "kv")
    for q0, nq, k0, nk in zip(q_starts, q_lens, kv_starts, kv_lens):
        if nq == 0 or nk == 0:
            continue
        q = query[q0 : q0 + nq].permute(1, 2, 0, 3)  # [b, np, nq, hn]
        k = key[k0 : k0 + nk].permute(1, 2, 0, 3)
        v = value[k0 : k0 + nk].permute(1, 2, 0, 3)
        out[q0 : q0 + nq] = F.scaled_dot_product_attention(q, k, v, scale=scale).permute(2, 0, 1, 3)
    return out


def document_ids(starts: list[int], lengths: list[int], total: int, device: torch.device) -> Tensor:
    """[total] long: sample index of each real token, -1 (q) on padding."""
    ids = torch.full((total,), -1, dtype=torch.long, device=device)
    for index, (start, length) in enumerate(zip(starts, lengths)):
        ids[start : start + length] = index
    return ids


@functools.lru_cache(maxsize=2)
def _flex_attention_for(on_cuda: bool):
    """Compiled where the tensors are on CUDA (eager flex is a slow reference there); eager on the CPU."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True) if on_cuda else flex_attention


def document_ids_on_device(params: PackedSeqParams, side: str, total: int, device: torch.device) -> Tensor:
    """Like :func:`document_ids`, computed from the cu_seqlens tensors with no host sync."""
    real = getattr(params, f"cu_seqlens_{side}").to(device)
    padded = getattr(params, f"cu_seqlens_{side}_padded")
    padded = real if padded is None else padded.to(device)
    positions = torch.arange(total, device=device)
    ids = torch.searchsorted(padded[1:].contiguous(), positions, right=True).clamp(max=len(real) - 2)
    lengths = segment_lengths(real)[ids]
    return torch.where(positions - padded[ids] < lengths, ids, -1)


def cached_per_pack(params: PackedSeqParams, name: str, key: tuple, build):
    """``build()`` once per pack, kept on ``params`` under ``name`` while ``key`` matches.

    The model hands every layer the same ``params`` object, so caching there turns one build
    per attention call into one per forward (measured: docs/performance.md).
    """
    cached = getattr(params, name, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    value = build()
    setattr(params, name, (key, value))
    return value


def query_is_real(params: PackedSeqParams, q_total: int, device: torch.device) -> Tensor:
    """[q_total, 1, 1, 1] bool: the query token is a sample's, not padding."""
    return cached_per_pack(
        params,
        "_dfm_q_valid",
        (q_total, device),
        lambda: (document_ids_on_device(params, "q", q_total, device) >= 0)[:, None, None, None],
    )


def document_block_mask(params: PackedSeqParams, sq: int, sk: int, device: torch.device):
    """The FlexAttention BlockMask of this pack: each real query sees its own sample's keys."""

    def build():
        from torch.nn.attention.flex_attention import create_block_mask

        q_doc = document_ids_on_device(params, "q", sq, device)
        kv_doc = document_ids_on_device(params, "kv", sk, device)

        def same_sample(b, h, q_idx, kv_idx):
            return (q_doc[q_idx] == kv_doc[kv_idx]) & (q_doc[q_idx] >= 0)

        return create_block_mask(same_sample, B=None, H=None, Q_LEN=sq, KV_LEN=sk, device=device)

    return cached_per_pack(params, "_dfm_flex_mask", (sq, sk, device), build)


def flex_document_attention(query: Tensor, key: Tensor, value: Tensor, params: PackedSeqParams, scale: float) -> Tensor:
    """Same contract as :func:`sdpa_per_segment`, one FlexAttention call with a document mask."""
    mask = document_block_mask(params, query.shape[0], key.shape[0], query.device)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    out = _flex_attention_for(q.is_cuda)(q, k, v, block_mask=mask, scale=scale).permute(2, 0, 1, 3)
    # Rows with no allowed key (padding) are undefined in flex; zero them as the reference does.
    return out * query_is_real(params, query.shape[0], query.device).to(out.dtype)


def _kernel(backend: str):
    """The packed kernel of a backend: ``(q, k, v, params, scale) -> out``, all [s, b, np, hn]."""
    if backend == "varlen":
        from dfm.models.common.varlen_attention import varlen_document_attention

        return varlen_document_attention
    return flex_document_attention if backend == "flex" else sdpa_per_segment


class PackedDotProductAttention(MegatronModule):
    """megatron ``core_attention`` for packed samples; ``backend`` picks the kernel."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type=None,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        backend: str = "sdpa",
    ):
        super().__init__(config=config)
        if backend not in BACKENDS:
            raise ValueError(f"unknown local attention backend {backend!r}; valid: {BACKENDS}")
        self.backend = backend
        self.kernel = _kernel(backend)
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else head_dim**-0.5

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None = None,
        attn_mask_type=None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        """query [sq, b, np, hn], key/value [sk, b, np, hn] -> [sq, b, np*hn]."""
        if packed_seq_params is None:
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out = F.scaled_dot_product_attention(q, k, v, scale=self.softmax_scale).permute(2, 0, 1, 3)
            return out.reshape(out.shape[0], out.shape[1], -1)
        kernel = functools.partial(attend_in_segment_order, self.kernel, scale=self.softmax_scale)
        context_parallel = getattr(packed_seq_params, "context_parallel", None)
        if context_parallel is not None:
            out = context_parallel(kernel, query, key, value)
        else:
            out = kernel(query, key, value, packed_seq_params)
        return out.reshape(out.shape[0], out.shape[1], -1)
