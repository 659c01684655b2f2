"""The DiT block's elementwise work as small functions, compiled per region when ``model.compile`` is on.

Around each attention and MLP a block normalises, modulates (x * (1 + scale) + shift) and adds a gated
residual: a few memory-bound passes over [s, b, h] each. ``torch.compile`` fuses each group into one
kernel. Only these pure functions are compiled (regional compilation): attention, the parallel linears
and their collectives stay eager, so nothing graph-breaks and compile time stays small.

Packs change length every step: the functions are compiled with dynamic shapes, so one graph serves
every length (``python -m benchmarks.recompiles`` counts graphs over 50 mixed packs). Arguments are
tensors and plain numbers only: a module argument would be guarded by identity and recompile per layer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx.experimental._config
import torch.nn.functional as F
from torch import Tensor

from dfm.models.common.norm_recompute import norm_modulate_rows
from dfm.models.common.one_sigmoid import (
    gelu_tanh_one_sigmoid,
    gelu_tanh_one_sigmoid_differentiable,
    swiglu_grad_one_sigmoid,
    transcendental_bound,
)
from dfm.models.common.row_modulation import gated_residual_rows


def residual(x: Tensor, out: Tensor, bias: Tensor | None) -> Tensor:
    """x + (out + bias) [s, b, h]: the cross-attention's ungated residual."""
    return x + out if bias is None else x + (out + bias)


def gelu_tanh(x: Tensor) -> Tensor:
    """tanh-GELU as autograd differentiates it (the compiled region's): through one sigmoid on the CPU, as
    the eager Function below computes it."""
    if transcendental_bound(x):
        return gelu_tanh_one_sigmoid_differentiable(x)
    return F.gelu(x, approximate="tanh")


class _GeluTanhGradInPlace(torch.autograd.Function):
    """tanh-GELU whose backward writes the input's gradient into the incoming one: no new [s, b, f]
    tensor in backward. On the CPU such a tensor (the MLP's widest) is a fresh mapping every step,
    faulted in page by page (small-4k-mix: ~2 % of its step, 2026-11-30). Values are F.gelu's, through
    one sigmoid on the CPU (one_sigmoid.py)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return gelu_tanh_one_sigmoid(x) if transcendental_bound(x) else F.gelu(x, approximate="tanh")

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        # The incoming gradient is the next linear's fresh input gradient; written over only when it is
        # a plain dense tensor (not an expanded one) and no graph of the backward is being built.
        if grad.is_contiguous() and not torch.is_grad_enabled():
            return torch.ops.aten.gelu_backward.grad_input(grad, x, approximate="tanh", grad_input=grad)
        return torch.ops.aten.gelu_backward(grad, x, approximate="tanh")


def gelu_tanh_grad_in_place(x: Tensor) -> Tensor:
    """The MLP's eager tanh-GELU, ``x`` [..., f] -> [..., f], its output feeding fc2 alone."""
    return _GeluTanhGradInPlace.apply(x)


def silu(x: Tensor) -> Tensor:
    return F.silu(x)


def swiglu(y: Tensor) -> Tensor:
    """silu(y1) * y2 of y = [y1, y2] [..., 2f] (fc1's output, gate half first) -> [..., f]."""
    y1, y2 = y.chunk(2, dim=-1)
    return F.silu(y1).mul_(y2)


def swiglu_grad(grad: Tensor, y: Tensor) -> Tensor:
    """d swiglu(y) given grad [..., f] of its output -> [..., 2f]; silu recomputed from y. SiLU's own
    backward kernel for the gate half, both halves written in place into one output: four passes over
    [..., f], no temporary and no concatenation (a copy of [..., 2f]). Eager on the CPU, silu's sigmoid
    computed once instead (one_sigmoid.py); inductor fuses these passes into one kernel anyway, and fails to
    trace that version's in-place chain on output views."""
    if transcendental_bound(y) and not torch.compiler.is_compiling():
        return swiglu_grad_one_sigmoid(grad, y)
    y1, y2 = y.chunk(2, dim=-1)
    d_y = torch.empty_like(y, memory_format=torch.contiguous_format)
    d_gate, d_up = d_y.chunk(2, dim=-1)
    torch.mul(grad, y2, out=d_up)  # scratch: the gate's incoming grad, overwritten below
    torch.ops.aten.silu_backward.grad_input(d_up, y1, grad_input=d_gate)
    torch.ops.aten.silu.out(y1, out=d_up)
    d_up.mul_(grad)
    return d_y


@dataclass(frozen=True)
class BlockOps:
    """The elementwise functions a block calls: eager or compiled, same signatures. The ``_rows`` pair
    takes per-sample modulation rows [N, h] and token ids [s] (row_modulation.py, norm_recompute.py):
    every block's modulation stays per sample, no op takes per-token shift / scale / gate."""

    residual: Callable[..., Tensor] = residual
    norm_modulate_rows: Callable[..., Tensor] = norm_modulate_rows
    gated_residual_rows: Callable[..., Tensor] = gated_residual_rows


def compile_region(fn: Callable, backend: str = "inductor") -> Callable:
    """``fn`` compiled with dynamic shapes (packs change length every step).

    Without duck sizing: by default a size that happens to equal another one when first traced (a pack
    of 256 tokens, a modulation chunk at storage offset 256) is assumed equal for good, and the next
    pack recompiles.
    """
    compiled = torch.compile(fn, dynamic=True, backend=backend)

    @functools.wraps(fn)
    def run(*args):
        with torch.fx.experimental._config.patch(use_duck_shape=False):
            return compiled(*args)

    return run


def padded_rows(rows: Tensor) -> Tensor:
    """rows [N, h] (a chunk view of the adaLN output) -> a fresh [N + 1, h], a zero row appended that no
    token takes. The compiled graph then sees N + 1 >= 2 rows at storage offset 0: dynamic shapes
    specialise sizes 0 and 1, and a view's storage offset, so a one-sample pack or another chunk of
    the same output would compile graphs of its own."""
    return torch.cat([rows, rows.new_zeros(1, rows.shape[1])])


def compiled_rows_ops(backend: str) -> tuple[Callable[..., Tensor], Callable[..., Tensor]]:
    """norm_modulate_rows and gated_residual_rows compiled, their rows passed through ``padded_rows``."""
    norm_mod, gated = compile_region(norm_modulate_rows, backend), compile_region(gated_residual_rows, backend)

    # Always gathered by ids (per_row 0): a per-pack number would be a guard, a graph per sample length.
    def norm_modulate_rows_compiled(x, shift_rows, scale_rows, ids, eps, rms, per_row=0):
        return norm_mod(x, padded_rows(shift_rows), padded_rows(scale_rows), ids, eps, rms)

    def gated_residual_rows_compiled(x, gate_rows, ids, out, bias, per_row=0):
        return gated(x, padded_rows(gate_rows), ids, out, bias)

    return norm_modulate_rows_compiled, gated_residual_rows_compiled


@functools.cache
def compiled_block_ops(backend: str = "inductor") -> BlockOps:
    """One compiled copy per process, shared by every layer (one graph per function, not per layer)."""
    return BlockOps(compile_region(residual, backend), *compiled_rows_ops(backend))


@functools.cache
def compiled_activation(fn: Callable, backend: str = "inductor") -> Callable:
    return compile_region(fn, backend)


def block_ops(compile: bool, backend: str = "inductor") -> BlockOps:
    return compiled_block_ops(backend) if compile else BlockOps()


def activation(gated: bool, compile: bool, backend: str = "inductor") -> Callable[[Tensor], Tensor]:
    """The MLP's activation (SiLU for SwiGLU blocks, tanh-GELU otherwise), compiled on request."""
    if compile:
        return compiled_activation(silu if gated else gelu_tanh, backend)
    return silu if gated else gelu_tanh_grad_in_place


def swiglu_fns(compile: bool, backend: str = "inductor") -> tuple[Callable, Callable]:
    """(swiglu, swiglu_grad), compiled on request (dfm/models/common/activation_mlp.py's region)."""
    if not compile:
        return swiglu, swiglu_grad
    return compiled_activation(swiglu, backend), compiled_activation(swiglu_grad, backend)
