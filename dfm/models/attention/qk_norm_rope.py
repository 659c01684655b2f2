"""Per-head q / k RMSNorm followed by RoPE in one autograd Function that keeps only its input.

    out = rotate(rms_norm(x) * weight, cos, sin)

Unfused, the norm's output [s, b, np, d] is saved by RoPE's multiplies besides the norm's own input.
Here the input x (a view of the fused QKV output, which the value view keeps alive anyway), the
per-head rstd [s, b, np, 1] and the shared cos / sin tables are saved; the normed tensor is
recomputed in backward. Forward values are those of ``F.rms_norm`` and megatron's RoPE.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dfm.models.attention.rope_tables import rotate, rotate_transposed
from dfm.models.common.norm_recompute import norm_backward


class _QKNormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, eps: float, interleaved: bool) -> Tensor:
        normed, rstd = torch._fused_rms_norm(x, x.shape[-1:], weight, eps)
        ctx.save_for_backward(x, rstd, weight, cos, sin)
        ctx.interleaved = interleaved
        return rotate(normed, cos, sin, interleaved)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, rstd, weight, cos, sin = ctx.saved_tensors
        acc = torch.promote_types(x.dtype, torch.float32)
        normed = x.to(acc) * rstd.to(acc)
        grad_weighted = rotate_transposed(grad.to(acc), cos.to(acc), sin.to(acc), ctx.interleaved)
        d_weight = None
        if ctx.needs_input_grad[1]:
            d_weight = (grad_weighted * normed).flatten(0, -2).sum(0).to(weight.dtype)
        d_x = norm_backward(grad_weighted * weight.to(acc), normed, rstd.to(acc), rms=True).to(x.dtype)
        return d_x, d_weight, None, None, None, None


def qk_norm_rope(x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, eps: float, interleaved: bool) -> Tensor:
    """x [s, b, np, d], weight [d], cos / sin [s, 1, 1, d] -> rotate(rms_norm(x) * weight) [s, b, np, d]."""
    return _QKNormRope.apply(x, weight, cos, sin, eps, interleaved)
