"""Segment attention on the CPU: one flash call per group of equal-length segments
(segment_plan.py), one output buffer, kept once for backward.

Through ``F.scaled_dot_product_attention`` each call's output is saved by its SDPA node and
copied again into the pack-wide output the output projection saves: two copies of [s, b, h]. Here
the same flash kernel runs per group inside one autograd Function; the outputs are written once
into the pack's buffer (zeros on padding rows; a view of the kernel's output when one group covers
the pack), and its backward hands the kernel's backward views of that buffer, so only the buffer
(which the projection keeps anyway) and the log-sum-exp [n, b*np, len] per group are saved. Values
are those of SDPA, which picks this kernel on the CPU.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend

from dfm.models.attention.segment_plan import Segment, SegmentPlan, assemble, gather, merged_heads, plan_segments


def heads_first(x: Tensor) -> Tensor:
    """[s, b, np, hn] -> the [b, np, s, hn] view a segment is sliced from (dim 2)."""
    return x.permute(1, 2, 0, 3)


def uses_cpu_flash(query: Tensor, key: Tensor, value: Tensor, scale: float) -> bool:
    """SDPA would run the CPU flash kernel on these [s, b, np, hn] inputs (handed to it as ``heads_first`` views):
    asked once per kind of input (``_fused_sdp_choice`` costs ~10-40 us a call, four calls a DiT block; its
    answer depends on the dtypes, batch and head counts, head dims, last-dim strides and the backend
    switches, not on the sequence lengths once they are non-zero), the kind read off the tensors unpermuted."""
    if query.device.type != "cpu":
        return False
    kind = (*(_sdpa_signature(t) for t in (query, key, value)), torch.backends.cuda.flash_sdp_enabled())
    choice = _FLASH_CHOICES.get(kind)
    if choice is None:
        q, k, v = heads_first(query), heads_first(key), heads_first(value)
        chosen = torch._fused_sdp_choice(q, k, v, scale=scale)
        choice = _FLASH_CHOICES[kind] = SDPBackend(chosen) == SDPBackend.FLASH_ATTENTION
    return choice


_FLASH_CHOICES: dict[tuple, bool] = {}  # uses_cpu_flash's answers by kind of input (a memo, like lru_cache)


def _sdpa_signature(x: Tensor) -> tuple:
    """What SDPA's backend choice reads of an [s, b, np, hn] input besides its length."""
    s, b, heads, head_dim = x.shape
    return x.dtype, b, heads, head_dim, x.stride(3), s > 0, x.requires_grad


def padded_concat(like: Tensor, outputs: list[tuple[int, Tensor]]) -> Tensor:
    """Segment outputs [n_i, b, np, hn] placed at their (ascending) starts, zero rows elsewhere:
    one [s, b, np, hn] tensor shaped like ``like``, written once."""
    pieces, end = [], 0
    for start, out in outputs:
        if start > end:
            pieces.append(like.new_zeros(start - end, *like.shape[1:]))
        pieces.append(out)
        end = start + out.shape[0]
    if end < like.shape[0]:
        pieces.append(like.new_zeros(like.shape[0] - end, *like.shape[1:]))
    return torch.cat(pieces)


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


class _SegmentAttentionCPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query: Tensor, key: Tensor, value: Tensor, plan: SegmentPlan, scale: float) -> Tensor:
        q, k, v = merged_heads(query), merged_heads(key), merged_heads(value)
        outputs, lse = [], []
        for group in plan.groups:
            keys = group.kv
            out, logsumexp = _FLASH(
                gather(q, group.q), gather(k, keys), gather(v, keys), attn_mask=group.bias(q.dtype), scale=scale
            )
            outputs.append(out)
            lse.append(logsumexp)
        out = assemble(query, plan, "q", outputs)
        ctx.save_for_backward(query, key, value, out, *lse)
        ctx.plan, ctx.scale = plan, scale
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        query, key, value, out, *lse = ctx.saved_tensors
        q, k, v, o, g = (merged_heads(t) for t in (query, key, value, out, grad))
        d_q, d_k, d_v = [], [], []
        for group, logsumexp in zip(ctx.plan.groups, lse):
            rows, keys = group.q, group.kv
            grads = _FLASH_BACKWARD(
                gather(g, rows),
                gather(q, rows),
                gather(k, keys),
                gather(v, keys),
                gather(o, rows),
                logsumexp,
                0.0,
                False,
                attn_mask=group.bias(q.dtype),
                scale=ctx.scale,
            )
            for parts, part in zip((d_q, d_k, d_v), grads):
                parts.append(part)
        add = not ctx.plan.kv_once  # kv rows read twice (context parallel) or padded slots: summed
        d_key, d_value = (assemble(t, ctx.plan, "kv", parts, add) for t, parts in ((key, d_k), (value, d_v)))
        return assemble(query, ctx.plan, "q", d_q), d_key, d_value, None, None


def grouped_attention_cpu(query: Tensor, key: Tensor, value: Tensor, plan: SegmentPlan, scale: float) -> Tensor:
    """query [sq, b, np, hn], key / value [sk, b, np, hn] -> [sq, b, np, hn]: one flash call per
    group of ``plan``; rows outside its query segments are 0."""
    return _SegmentAttentionCPU.apply(query, key, value, plan, scale)


def segment_attention_cpu(query: Tensor, key: Tensor, value: Tensor, segments: list[Segment], scale: float) -> Tensor:
    """The same over a list of (disjoint in q) ``segments``, planned here."""
    plan = plan_segments(segments, query.shape[0], key.shape[0], query.device)
    return grouped_attention_cpu(query, key, value, plan, scale)
