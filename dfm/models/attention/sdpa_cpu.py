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


def heads_first(x: Tensor, start: int, length: int) -> Tensor:
    """[s, b, np, hn] -> the segment's [b, np, length, hn] view."""
    return x[start : start + length].permute(1, 2, 0, 3)


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


class _SegmentAttentionCPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query: Tensor, key: Tensor, value: Tensor, segments: list[Segment], scale: float) -> Tensor:
        outputs, lse = [], []
        for q0, nq, k0, nk in segments:
            out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                heads_first(query, q0, nq),
                heads_first(key, k0, nk),
                heads_first(value, k0, nk),
                0.0,
                False,
                scale=scale,
            )
            outputs.append((q0, out.permute(2, 0, 1, 3)))
            lse.append(logsumexp)
        out = padded_concat(query, outputs)
        ctx.save_for_backward(query, key, value, out, *lse)
        ctx.segments, ctx.scale = segments, scale
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        query, key, value, out, *lse = ctx.saved_tensors
        grads = [torch.zeros_like(t) for t in (query, key, value)]
        for (q0, nq, k0, nk), logsumexp in zip(ctx.segments, lse):
            seg_grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                heads_first(grad, q0, nq),
                heads_first(query, q0, nq),
                heads_first(key, k0, nk),
                heads_first(value, k0, nk),
                heads_first(out, q0, nq),
                logsumexp,
                0.0,
                False,
                scale=ctx.scale,
            )
            for total, seg, (start, length) in zip(grads, seg_grads, ((q0, nq), (k0, nk), (k0, nk))):
                heads_first(total, start, length).add_(seg)
        return *grads, None, None


def segment_attention_cpu(query: Tensor, key: Tensor, value: Tensor, segments: list[Segment], scale: float) -> Tensor:
    """query [sq, b, np, hn], key / value [sk, b, np, hn] -> [sq, b, np, hn]; rows outside the
    (ordered, disjoint) query segments are 0."""
    return _SegmentAttentionCPU.apply(query, key, value, segments, scale)
