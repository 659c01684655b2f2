"""Per-head q / k RMSNorm followed by RoPE in one autograd Function that keeps only its input.

    out = rotate(rms_norm(x) * weight, cos, sin)

Unfused, the norm's output [s, b, np, d] is saved by RoPE's multiplies besides the norm's own input.
Here the input x (a view of the fused QKV output, which the value view keeps alive anyway), the
per-head rstd [s, b, np, 1] and the shared cos / sin tables are saved; the normed tensor is
recomputed in backward. Forward values are those of ``F.rms_norm`` and megatron's RoPE.

cos / sin in a wider dtype than x (FLUX: fp32 tables for bf16 heads) rotate in that dtype and round
the result to x's, as diffusers' ``apply_rotary_emb`` does; cos / sin None: the norm alone (FLUX's
text tokens, whose positions are all 0).

On the CPU the output [s, b, np, d] is laid out heads-major (memory [b, np, s, d]), as SDPA's CPU flash
kernel reads q and k fastest; the values are the same.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dfm.models.attention.heads_layout import heads_major, made_heads_major, token_major
from dfm.models.attention.rope_tables import rotate, rotate_transposed
from dfm.models.common.dtypes import accumulation_dtype, as_dtype
from dfm.models.common.norm_recompute import scaled_rows_backward


def rms_norm_heads_major(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``torch._fused_rms_norm`` of x [s, b, np, d] (fp32 / fp64) on the CPU, there a composite of these ops
    in this order (the same values), with the output laid out heads-major (heads_layout.py; the last
    product written there, not a copy after). -> (normed [s, b, np, d], rstd [s, b, np, 1])."""
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))
    normed = torch.empty(heads_major(x).shape, dtype=x.dtype, device=x.device)
    torch.mul(heads_major(x), heads_major(rstd), out=normed)
    return token_major(normed.mul_(weight)), rstd


class _QKNormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, eps: float, interleaved: bool) -> Tensor:
        by_head = made_heads_major(x) and x.dtype == weight.dtype and x.dtype in (torch.float32, torch.float64)
        if by_head:
            normed, rstd = rms_norm_heads_major(x, weight, eps)
        else:
            normed, rstd = torch._fused_rms_norm(x, x.shape[-1:], weight, eps)
        ctx.save_for_backward(x, rstd, weight, cos, sin)
        ctx.interleaved = interleaved
        if cos is None:
            return normed
        if by_head:  # rotated over the heads-major views, so the output keeps that layout
            return token_major(rotate(heads_major(normed), heads_major(cos), heads_major(sin), interleaved).to(x.dtype))
        return rotate(normed, cos, sin, interleaved).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, rstd, weight, cos, sin = ctx.saved_tensors
        acc = accumulation_dtype(x)
        rstd = as_dtype(rstd, acc)
        normed = as_dtype(x, acc) * rstd
        grad_weighted = as_dtype(grad, acc)
        if cos is not None:
            grad_weighted = rotate_transposed(grad_weighted, as_dtype(cos, acc), as_dtype(sin, acc), ctx.interleaved)
        weight_acc = as_dtype(weight, acc)
        # grad * normed serves both: the weight's grad sums it over tokens, the norm's backward its rows
        # weighted (the rows' sums of grad * weight * normed).
        product = grad_weighted * normed
        d_weight = None
        if ctx.needs_input_grad[1]:
            d_weight = as_dtype(product.flatten(0, -2).sum(0), weight.dtype)
        row_sums = (product * weight_acc).sum(-1)
        d_x = scaled_rows_backward(grad_weighted * weight_acc, normed, rstd, row_sums)
        return as_dtype(d_x, x.dtype), d_weight, None, None, None, None


def qk_norm_rope(
    x: Tensor, weight: Tensor, cos: Tensor | None, sin: Tensor | None, eps: float, interleaved: bool
) -> Tensor:
    """x [s, b, np, d], weight [d], cos / sin [s, 1, 1, d] (or None: no rotation) ->
    rotate(rms_norm(x) * weight) [s, b, np, d] in x's dtype."""
    return _QKNormRope.apply(x, weight, cos, sin, eps, interleaved)
