"""Wan's q / k RMSNorm across all heads of a token (and RoPE, in self-attention) keeping only its input.

    out = rotate((x * rsqrt(variance)).to(x.dtype) * weight, cos, sin),  variance = sum(x^2) / (np hn) + eps

Two autograd Functions, the TP all-reduce of the sum of squares between them (norms.py), as the
unfused ops run it: the sum of squares saves x; the norm (+ RoPE) saves x, the per-token variance
[s, b, 1, 1] and the shared cos / sin tables, and recomputes the normed tensor in backward. x is a
view of the QKV (or q / kv linear) output, which the value keeps alive anyway: nothing of size
[s, b, np, hn] is kept besides it. Unfused, autograd keeps fp32 copies of a bf16 x (for the square
and the scaling), the normed tensor (for the weight multiply) and the weighted one (for RoPE).
Forward values are those of the unfused ops (the same products in the same dtypes).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dfm.models.attention.rope_tables import rotate, rotate_transposed
from dfm.models.common.dtypes import accumulation_dtype


class _SquareSum(torch.autograd.Function):
    """x [s, b, np, hn] -> sum of x^2 over the heads and channels [s, b, 1, 1] in at least fp32, saving x."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return x.to(accumulation_dtype(x)).pow(2).sum(dim=(-2, -1), keepdim=True)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (x,) = ctx.saved_tensors
        return (2 * x.to(grad.dtype) * grad).to(x.dtype)


class _AcrossHeadsNormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, variance: Tensor, weight: Tensor, cos, sin, interleaved: bool) -> Tensor:
        normed = (x.to(variance.dtype) * torch.rsqrt(variance)).to(x.dtype) * weight.view(-1, x.shape[-1])
        ctx.save_for_backward(x, variance, weight, cos, sin)
        ctx.interleaved = interleaved
        return normed if cos is None else rotate(normed, cos, sin, interleaved)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, variance, weight, cos, sin = ctx.saved_tensors
        acc = accumulation_dtype(x)
        grad = grad.to(acc)
        if cos is not None:
            grad = rotate_transposed(grad, cos.to(acc), sin.to(acc), ctx.interleaved)
        rstd, x_acc = torch.rsqrt(variance.to(acc)), x.to(acc)
        d_weight = None
        if ctx.needs_input_grad[2]:
            d_weight = (grad * x_acc * rstd).flatten(0, -3).sum(0).flatten().to(weight.dtype)
        grad_normed = grad * weight.view(-1, x.shape[-1]).to(acc)
        # d out / d variance: -rstd^3 / 2 times the token's sum of grad_normed * x
        d_variance = (grad_normed * x_acc).sum(dim=(-2, -1), keepdim=True) * (-0.5 * rstd.pow(3))
        return (grad_normed * rstd).to(x.dtype), d_variance.to(variance.dtype), d_weight, None, None, None


def square_sum(x: Tensor) -> Tensor:
    """x [s, b, np, hn] -> [s, b, 1, 1]: sum of squares over the token's (local) heads, at least fp32."""
    return _SquareSum.apply(x)


def across_heads_norm_rope(
    x: Tensor, variance: Tensor, weight: Tensor, cos: Tensor | None, sin: Tensor | None, interleaved: bool
) -> Tensor:
    """x [s, b, np, hn], variance [s, b, 1, 1] (mean square + eps), weight [np hn], cos / sin [s, 1, 1, hn]
    or None (no RoPE) -> rotate((x / sqrt(variance)).to(x.dtype) * weight) [s, b, np, hn]."""
    return _AcrossHeadsNormRope.apply(x, variance, weight, cos, sin, interleaved)
