"""megatron's MLP with dfm's activation between fc1 and fc2, keeping fewer tensors for backward.

* SwiGLU is one autograd region that saves fc1's output y alone and recomputes silu in backward.
  megatron's unfused gated path (``bias_activation_fusion`` off, as dfm runs it) keeps silu(y1) and a
  copy ``y2 + glu_linear_offset`` (its ``x + 0``) besides y: 2 f more values per token.
* ``recompute_activation``: fc2 keeps its input (the activation's output, f per token) for its weight
  gradient; instead the activation is recomputed from fc1's output (kept by the activation anyway)
  when the backward unpacks it. One elementwise pass more in backward, f values per token less.

Same submodules and parameter names as megatron's MLP: checkpoints load unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from megatron.core.transformer.mlp import MLP
from torch import Tensor

from dfm.models.common.fused import activation, swiglu_fns
from dfm.platform.torch_api import top_saved_tensors_hooks


class SwiGLU(torch.autograd.Function):
    """y [..., 2f] -> silu(y1) * y2 [..., f], saving y only."""

    @staticmethod
    def forward(ctx, y: Tensor, forward: Callable, grad: Callable) -> Tensor:
        ctx.save_for_backward(y)
        ctx.grad = grad
        return forward(y)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        (y,) = ctx.saved_tensors
        return ctx.grad(grad_out, y), None, None


def activation_region(gated: bool, compile: bool) -> Callable[[Tensor], Tensor]:
    """fc1 output -> fc2 input: SwiGLU (one region) when ``gated``, else tanh-GELU; compiled on request."""
    if not gated:
        return activation(gated=False, compile=compile)
    forward, grad = swiglu_fns(compile)
    return lambda y: SwiGLU.apply(y, forward, grad)


def _same(a: Tensor, b: Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


@contextlib.contextmanager
def recomputed(output: Tensor, source: Tensor, fn: Callable[[Tensor], Tensor]) -> Iterator[None]:
    """Within the block, autograd saves ``output`` (= fn(source)) as ``source`` and rebuilds it when the
    backward unpacks it. Every saved tensor still goes through the enclosing saved-tensor hooks, if any
    (full-layer checkpointing, a measurement): they see ``source`` in place of ``output``."""
    # Nested saved-tensor hooks replace the enclosing ones (no public API composes them): ours call
    # theirs, or full-layer checkpointing would keep ``source`` alive and a measurement would miss it.
    outer = top_saved_tensors_hooks()
    outer_pack, outer_unpack = outer if outer is not None else (lambda t: t, lambda t: t)

    def pack(tensor: Tensor):
        rebuild = _same(tensor, output)
        return rebuild, outer_pack(source if rebuild else tensor)

    def unpack(packed) -> Tensor:
        rebuild, value = packed
        value = outer_unpack(value)
        return fn(value) if rebuild else value

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


class ActivationMLP(MLP):
    """fc1 -> activation region -> fc2. hidden [s, b, h] -> ([s, b, h], fc2 bias or None)."""

    def forward(self, hidden_states: Tensor, per_token_scale: Tensor | None = None, **kwargs):
        if per_token_scale is not None:  # MoE experts' weighting: megatron's own path
            return super().forward(hidden_states, per_token_scale, **kwargs)
        fc1, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            fc1 = fc1 + bias
        act = activation_region(self.config.gated_linear_unit, self.config.compile_regions)
        out = act(fc1)
        keep = self.config.recompute_activation and torch.is_grad_enabled()
        with recomputed(out, fc1, act) if keep else contextlib.nullcontext():
            return self.linear_fc2(out)
