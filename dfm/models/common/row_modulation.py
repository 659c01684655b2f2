"""adaLN modulation kept per sample: shift / scale / gate stay rows [N, h] and reach tokens inside the op.

A per-token copy of the modulation ([s, 6h] for a DiT block, the gather of ``rows_to_tokens``) is as
large as six activations, and the gate multiplies' views keep it alive until the backward. Here the
gathers happen inside two autograd Functions that save only the rows, the token ids and the inputs
they must have; the backward gathers again (cheap) and sums the per-token grads back into rows.

Shapes: x, out [s, b, h]; rows [N, h] (N samples, one row each); ids [s] long, the row of each token
(under sequence parallelism: this rank's slice of the tokens, the rows whole). ``per_row`` (``RowLayout``)
says how the tokens lie: an int L > 0, N runs of L tokens in row order (every sample the same length, the
usual batch of one shape), so rows broadcast over x viewed [N, L, b, h]; a tuple of (rows, L) runs, the
same for consecutive groups of rows of one length each (a mixed pack grouped by length,
``dfm.data.packing.grouped_by_length``), one broadcast per group; 0: rows gathered by ids. No per-token
copy is made but by the gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dfm.models.common.adaln import AdaLNModulation, sum_rows_by_index_add, sum_rows_by_one_hot_gemm
from dfm.models.common.dtypes import accumulation_dtype, as_dtype

RowLayout = int | tuple[tuple[int, int], ...]  # how tokens lie by row: see the module docstring


@dataclass(frozen=True)
class ModulationRows:
    """One adaLN chunk (shift, scale or gate): rows [N, h], the row of each token, ids [s], and the
    tokens per row when every row has that many, in order (0: not so)."""

    rows: Tensor
    ids: Tensor
    per_row: RowLayout = 0


class AdaLNRows(AdaLNModulation):
    """``AdaLNModulation`` (same parameters) that hands out per-sample rows instead of per-token copies:
    cond [N, h], token_sample_ids [s] -> num_chunks x ModulationRows (rows [N, h])."""

    def forward(self, cond: Tensor, token_sample_ids: Tensor, per_row: RowLayout = 0) -> tuple[ModulationRows, ...]:
        chunks = self.rows(cond).chunk(self.num_chunks, dim=-1)
        return tuple(ModulationRows(rows, token_sample_ids, per_row) for rows in chunks)


def gather_rows(rows: Tensor, ids: Tensor) -> Tensor:
    """rows [N, h], ids [s] -> [s, 1, h]."""
    return rows.index_select(0, ids).unsqueeze(1)


# A broadcast per run costs a few op calls a run; the gather it replaces, a pass over the tokens. Runs are
# broadcast when they average this many elements (tokens x width) or more: small-4k-mix (runs of ~960
# tokens x 256) steps 2 % faster so, tiny-1k-mix (~330 x 64) 0.5 % slower (CPU, 2026-11-30).
MIN_RUN_ELEMENTS = 1 << 16


def row_layout(lengths: list[int], num_tokens: int, width: int) -> RowLayout:
    """The ``RowLayout`` of tokens [num_tokens, width] made of samples of ``lengths`` tokens each (padding
    included), in row order."""
    if not lengths or sum(lengths) != num_tokens:
        return 0
    runs: list[list[int]] = []
    for n in lengths:
        if runs and runs[-1][1] == n:
            runs[-1][0] += 1
        else:
            runs.append([1, n])
    if len(runs) == 1:
        return runs[0][1]
    return tuple((rows, n) for rows, n in runs) if num_tokens * width >= MIN_RUN_ELEMENTS * len(runs) else 0


def by_row(x: Tensor, per_row: int) -> Tensor:
    """x [s, b, h] as [N, per_row, b, h] (a view) when ``per_row``, else as it is."""
    return x.view(-1, per_row, *x.shape[1:]) if per_row else x


def token_rows(rows: Tensor, ids: Tensor, per_row: int) -> Tensor:
    """rows [N, h] per token, to broadcast against ``by_row(x, per_row)``: [N, 1, 1, h] (a view) when
    ``per_row``, else gathered [s, 1, h]."""
    return rows[:, None, None] if per_row else gather_rows(rows, ids)


def run_views(x: Tensor, rows: list[Tensor], per_row: RowLayout) -> list[tuple[Tensor, ...]]:
    """Per run: x's tokens [n, L, b, h] (a view) and each of ``rows`` [n, 1, 1, h] (views)."""
    if not isinstance(per_row, tuple):
        return [(by_row(x, per_row), *(r[:, None, None] for r in rows))]
    views, token, row = [], 0, 0
    for n, length in per_row:
        part = x[token : token + n * length].view(n, length, *x.shape[1:])
        views.append((part, *(r[row : row + n, None, None] for r in rows)))
        token, row = token + n * length, row + n
    return views


def scale_shift_rows_(x: Tensor, scale: Tensor, shift: Tensor, ids: Tensor, per_row: RowLayout) -> Tensor:
    """x [s, b, h] * scale[ids] + shift[ids] in place (rows [N, h] in x's dtype) -> x."""
    if not per_row:
        return x.mul_(gather_rows(scale, ids)).add_(gather_rows(shift, ids))
    for part, scale_part, shift_part in run_views(x, [scale, shift], per_row):
        part.mul_(scale_part).add_(shift_part)
    return x


def times_rows(x: Tensor, rows: Tensor, ids: Tensor, per_row: RowLayout) -> Tensor:
    """x [s, b, h] * rows[ids] -> a new [s, b, h] tensor (the type promoted as ``*`` does)."""
    if not isinstance(per_row, tuple):
        return (by_row(x, per_row) * token_rows(rows, ids, per_row)).view_as(x)
    out = x.new_empty(x.shape, dtype=torch.result_type(x, rows))
    for (part, row_part), (out_part,) in zip(run_views(x, [rows], per_row), run_views(out, [], per_row)):
        torch.mul(part, row_part, out=out_part)
    return out


def sum_to_rows(grad: Tensor, ids: Tensor, num_rows: int, per_row: RowLayout = 0) -> Tensor:
    """Per-token grads [s, b, h] -> [N, h], row n summing its tokens' (and batch entries') grads."""
    if per_row:
        sums = [part.sum((1, 2), dtype=accumulation_dtype(grad)) for (part,) in run_views(grad, [], per_row)]
        return as_dtype(sums[0] if len(sums) == 1 else torch.cat(sums), grad.dtype)
    grad = grad.sum(1) if grad.shape[1] > 1 else grad[:, 0]
    sum_rows = sum_rows_by_one_hot_gemm if grad.is_cuda else sum_rows_by_index_add
    return sum_rows(grad.contiguous(), ids, num_rows)


def sum_pair_to_rows(a: Tensor, b: Tensor, ids: Tensor, num_rows: int, per_row: RowLayout = 0) -> tuple[Tensor, Tensor]:
    """``sum_to_rows`` of two [s, b, h] grads: on CUDA as one one-hot GEMM over them side by side, elsewhere
    apart (a concatenation costs a pass over both; the sums are the same either way on the CPU)."""
    if a.is_cuda and not per_row:
        return sum_to_rows(torch.cat([a, b], dim=-1), ids, num_rows).chunk(2, dim=-1)
    return sum_to_rows(a, ids, num_rows, per_row), sum_to_rows(b, ids, num_rows, per_row)


class _GatedResidualRows(torch.autograd.Function):
    """x + gate[ids] * (out + bias), saving the gate rows, ids, out and bias (no per-token gate)."""

    @staticmethod
    def forward(ctx, x: Tensor, gate_rows: Tensor, ids: Tensor, out: Tensor, bias: Tensor | None, per_row: RowLayout):
        ctx.save_for_backward(gate_rows, ids, out, bias)
        ctx.per_row = per_row
        return add_to_product(x, times_rows(out if bias is None else out + bias, gate_rows, ids, per_row))

    @staticmethod
    def backward(ctx, grad: Tensor):
        gate_rows, ids, out, bias = ctx.saved_tensors
        per_row = ctx.per_row
        d_gate = d_out = d_bias = None
        if ctx.needs_input_grad[1]:
            branch = out if bias is None else out + bias
            d_gate = as_dtype(sum_to_rows(grad * branch, ids, gate_rows.shape[0], per_row), gate_rows.dtype)
        if ctx.needs_input_grad[3] or ctx.needs_input_grad[4]:
            d_out = times_rows(grad, gate_rows, ids, per_row)
            if bias is not None and ctx.needs_input_grad[4]:
                d_bias = as_dtype(d_out.sum(dim=(0, 1)), bias.dtype)
        return grad, d_gate, None, d_out, d_bias, None


def gated_residual_rows(
    x: Tensor, gate_rows: Tensor, ids: Tensor, out: Tensor, bias: Tensor | None, per_row: RowLayout = 0
) -> Tensor:
    """x [s, b, h] + gate_rows[ids] * (out [s, b, h] + bias [h]); gate_rows [N, h], ids [s].

    One shape (an int ``per_row``) without a bias: plain ops, the rows broadcast over a view of ``out``;
    autograd's multiply then saves what the Function would (the rows and ``out``), at less cost a call."""
    if per_row and not isinstance(per_row, tuple) and bias is None:
        return add_to_product(x, gate_rows[:, None, None] * by_row(out, per_row))
    return _GatedResidualRows.apply(x, gate_rows, ids, out, bias, per_row)


def add_to_product(x: Tensor, product: Tensor) -> Tensor:
    """x [s, b, h] + product (x's shape or its ``by_row`` view), added into the product when it has the
    sum's dtype: on the CPU a tensor from 4 MiB is a fresh mapping faulted in page by page."""
    if torch.result_type(x, product) != product.dtype:
        return x + product.view_as(x)
    return product.add_(x.view_as(product)).view_as(x)
