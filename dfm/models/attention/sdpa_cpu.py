"""Per-segment attention on the CPU with one output buffer, kept once for backward.

Through ``F.scaled_dot_product_attention`` each segment's output is saved by its SDPA node and
copied again into the pack-wide output the output projection saves: two copies of [s, b, h]. Here
the same flash kernel runs per segment inside one autograd Function; the segment outputs are written
once into the pack's buffer (zeros on padding rows), and its backward hands the kernel's backward
views of that buffer, so only the buffer (which the projection keeps anyway) and the per-segment
log-sum-exp [b, np, nq] are saved. Values are those of SDPA, which picks this kernel on the CPU.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend

Segment = tuple[int, int, int, int]  # (q start, q length, kv start, kv length), all > 0 lengths


def heads_first(x: Tensor) -> Tensor:
    """[s, b, np, hn] -> the [b, np, s, hn] view a segment is sliced from (dim 2)."""
    return x.permute(1, 2, 0, 3)


def uses_cpu_flash(query: Tensor, key: Tensor, value: Tensor, scale: float) -> bool:
    """SDPA would run the CPU flash kernel on these [b, np, s, hn] inputs."""
    if query.device.type != "cpu":
        return False
    return SDPBackend(torch._fused_sdp_choice(query, key, value, scale=scale)) == SDPBackend.FLASH_ATTENTION


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


def ordered_disjoint(segments: list[Segment]) -> bool:
    """The kv ranges of ``segments`` follow one another without overlap (false under context
    parallelism, where two query chunks of a sample read the same keys)."""
    ends = [k0 + nk for _, _, k0, nk in segments]
    return all(k0 >= end for (_, _, k0, _), end in zip(segments[1:], ends))


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


class _SegmentAttentionCPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query: Tensor, key: Tensor, value: Tensor, segments: list[Segment], scale: float) -> Tensor:
        q, k, v = heads_first(query), heads_first(key), heads_first(value)
        outputs, lse = [], []
        for q0, nq, k0, nk in segments:
            out, logsumexp = _FLASH(q[:, :, q0 : q0 + nq], k[:, :, k0 : k0 + nk], v[:, :, k0 : k0 + nk], scale=scale)
            outputs.append((q0, out.permute(2, 0, 1, 3)))
            lse.append(logsumexp)
        out = padded_concat(query, outputs)
        ctx.save_for_backward(query, key, value, out, *lse)
        ctx.segments, ctx.scale = segments, scale
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        query, key, value, out, *lse = ctx.saved_tensors
        q, k, v, o, g = (heads_first(t) for t in (query, key, value, out, grad))
        q_parts, kv_parts = [], []
        for (q0, nq, k0, nk), logsumexp in zip(ctx.segments, lse):
            rows, keys = slice(q0, q0 + nq), slice(k0, k0 + nk)
            d_q, d_k, d_v = _FLASH_BACKWARD(
                g[:, :, rows],
                q[:, :, rows],
                k[:, :, keys],
                v[:, :, keys],
                o[:, :, rows],
                logsumexp,
                0.0,
                False,
                scale=ctx.scale,
            )
            q_parts.append((q0, d_q.permute(2, 0, 1, 3)))
            kv_parts.append((k0, d_k.permute(2, 0, 1, 3), d_v.permute(2, 0, 1, 3)))
        d_query = padded_concat(query, q_parts)  # query segments never overlap: written once
        if ordered_disjoint(ctx.segments):
            d_key = padded_concat(key, [(k0, d_k) for k0, d_k, _ in kv_parts])
            d_value = padded_concat(value, [(k0, d_v) for k0, _, d_v in kv_parts])
        else:
            d_key, d_value = torch.zeros_like(key), torch.zeros_like(value)
            for k0, d_k, d_v in kv_parts:
                d_key[k0 : k0 + d_k.shape[0]] += d_k
                d_value[k0 : k0 + d_v.shape[0]] += d_v
        return d_query, d_key, d_value, None, None


def segment_attention_cpu(query: Tensor, key: Tensor, value: Tensor, segments: list[Segment], scale: float) -> Tensor:
    """query [sq, b, np, hn], key / value [sk, b, np, hn] -> [sq, b, np, hn]; rows outside the
    (ordered, disjoint) query segments are 0."""
    return _SegmentAttentionCPU.apply(query, key, value, segments, scale)
