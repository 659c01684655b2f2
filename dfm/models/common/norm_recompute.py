"""Affine-free LayerNorm / RMSNorm followed by adaLN modulation, the normed tensor recomputed in backward.

    out = norm(x) * (1 + scale[ids]) + shift[ids]

Saved for backward: x (the residual stream, which the next op needs anyway), the per-token statistics
(mean and rstd [s, b, 1]; rstd alone for RMSNorm), the scale rows [N, h] and ids [s]; not norm(x)
[s, b, h] nor a per-token (1 + scale). The forward runs the same kernels as ``F.layer_norm`` /
``F.rms_norm``, so outputs are bitwise those of the unfused ops.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dfm.models.common.dtypes import accumulation_dtype, as_dtype
from dfm.models.common.row_modulation import RowLayout, scale_shift_rows_, sum_pair_to_rows, times_rows


def norm_with_stats(x: Tensor, eps: float, rms: bool) -> tuple[Tensor, Tensor | None, Tensor]:
    """x [s, b, h] -> (norm(x), mean [s, b, 1] or None for RMSNorm, rstd [s, b, 1])."""
    if rms:
        normed, rstd = torch._fused_rms_norm(x, x.shape[-1:], None, eps)
        return normed, None, rstd
    return torch.native_layer_norm(x, x.shape[-1:], None, None, eps)


def rms_norm_backward(grad_normed: Tensor, normed: Tensor, rstd: Tensor) -> Tensor:
    """d loss / d x of the affine-free RMSNorm from d loss / d norm(x) (all [..., h], rstd [..., 1]):
    rstd * (g - normed * mean(g * normed))."""
    return scaled_rows_backward(grad_normed, normed, rstd, (grad_normed * normed).sum(-1))


def scaled_rows_backward(grad_normed: Tensor, normed: Tensor, rstd: Tensor, sums: Tensor) -> Tensor:
    """rstd * (g - normed * sums / h), ``sums`` [...] the rows' sums of g * normed: one ``addcmul`` and an
    in-place scale. As a broadcast subtraction and a product it took 1.6-1.9x the time over
    [2048, 1, 4, 16] (q / k heads) and 1.4x over [4096, 1, 256] on the CPU (2026-11-30)."""
    coef = sums.unsqueeze(-1).mul_(-1.0 / normed.shape[-1])
    return torch.addcmul(grad_normed, normed, coef).mul_(rstd)


def norm_input_grad(grad_normed: Tensor, x: Tensor, mean: Tensor | None, rstd: Tensor, normed: Tensor | None) -> Tensor:
    """d loss / d x [s, b, h] in backward's precision from d loss / d norm(x) (in that precision).

    LayerNorm (``mean`` given) through its native backward kernel, one pass from x and the saved
    statistics; RMSNorm (no CPU kernel) by ``rms_norm_backward`` on ``normed`` (recomputed: ``normed_again``)."""
    acc = grad_normed.dtype
    if mean is None:
        return rms_norm_backward(grad_normed, normed, as_dtype(rstd, acc))
    mask = [True, False, False]
    return torch.ops.aten.native_layer_norm_backward(
        grad_normed, as_dtype(x, acc), x.shape[-1:], as_dtype(mean, acc), as_dtype(rstd, acc), None, None, mask
    )[0]


def normed_again(x: Tensor, mean: Tensor | None, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """(norm(x), rstd) recomputed from the saved statistics in at least fp32 (backward's precision)."""
    acc = accumulation_dtype(x)
    x, rstd = as_dtype(x, acc), as_dtype(rstd, acc)
    if mean is None:
        return x * rstd, rstd
    # Scaled in place: on the CPU a tensor from 4 MiB is a fresh mapping faulted in page by page.
    return (x - as_dtype(mean, acc)).mul_(rstd), rstd


class _NormModulateRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shift_rows, scale_rows, ids, eps: float, rms: bool, per_row: RowLayout) -> Tensor:  # noqa: PLR0913 - ctx + apply's 7
        normed, mean, rstd = norm_with_stats(x, eps, rms)
        ctx.save_for_backward(x, mean, rstd, scale_rows, ids)
        ctx.per_row = per_row
        # (1 + scale) on the rows, then gathered: one pass over [s, b, h] less, the same values.
        scale = 1 + scale_rows
        dtype = torch.result_type(normed, scale)
        if not dtype == normed.dtype == torch.result_type(normed, shift_rows):  # wider rows: modulated in theirs
            wider = torch.promote_types(dtype, shift_rows.dtype)
            normed, scale, shift_rows = normed.to(wider), scale.to(wider), shift_rows.to(wider)
        return scale_shift_rows_(normed, scale, shift_rows, ids, per_row)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, mean, rstd, scale_rows, ids = ctx.saved_tensors
        normed, rstd = normed_again(x, mean, rstd)  # recompute and reduce in at least fp32
        grad = as_dtype(grad, normed.dtype)
        per_row, num_rows = ctx.per_row, scale_rows.shape[0]
        # LayerNorm's input grad comes from x and the statistics: normed is free to take the product.
        product = grad * normed if mean is None else normed.mul_(grad)
        d_shift, d_scale = sum_pair_to_rows(grad, product, ids, num_rows, per_row)
        d_x = None
        if ctx.needs_input_grad[0]:
            grad_normed = times_rows(grad, 1 + as_dtype(scale_rows, normed.dtype), ids, per_row)
            d_x = as_dtype(norm_input_grad(grad_normed, x, mean, rstd, normed), x.dtype)
        rows_dtype = scale_rows.dtype
        return d_x, as_dtype(d_shift, rows_dtype), as_dtype(d_scale, rows_dtype), None, None, None, None


class _Norm(torch.autograd.Function):
    """The affine-free norm alone, saving x and its statistics: F.rms_norm on the CPU upcasts a bf16
    input and keeps that fp32 copy for backward (2 more bytes per element than x itself)."""

    @staticmethod
    def forward(ctx, x, eps: float, rms: bool) -> Tensor:
        normed, mean, rstd = norm_with_stats(x, eps, rms)
        ctx.save_for_backward(x, mean, rstd)
        ctx.rms = rms
        return normed

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, mean, rstd = ctx.saved_tensors
        normed = normed_again(x, mean, rstd)[0] if ctx.rms else None
        d_x = norm_input_grad(as_dtype(grad, accumulation_dtype(x)), x, mean, rstd, normed)
        return as_dtype(d_x, x.dtype), None, None


def norm_recomputed(x: Tensor, eps: float, rms: bool) -> Tensor:
    """Affine-free LayerNorm / RMSNorm of x [s, b, h], keeping x and the statistics only."""
    return _Norm.apply(x, eps, rms)


def norm_modulate_rows(
    x: Tensor, shift_rows: Tensor, scale_rows: Tensor, ids: Tensor, eps: float, rms: bool, per_row: RowLayout = 0
) -> Tensor:
    """norm(x [s, b, h]) * (1 + scale_rows[ids]) + shift_rows[ids]; rows [N, h], ids [s] -> [s, b, h]
    (``per_row``: row_modulation.py)."""
    return _NormModulateRows.apply(x, shift_rows, scale_rows, ids, eps, rms, per_row)
