"""The MLP activations' CPU kernels: one sigmoid and a few multiplies instead of slower transcendentals.

On the CPU an exp-like pass costs several multiplies: on the 2-core AVX2 test machine (one thread,
[2048, 256] float32) tanh 1.9 ms, exp 0.63, sigmoid 0.53, a multiply 0.07-0.1. tanh-GELU is
x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3)) exactly (0.5 (1 + tanh z) = sigmoid(2 z)): 0.93 ms
against F.gelu's 1.9. SwiGLU's backward needs sigmoid(y1) twice (silu's derivative and silu itself);
computed once it saves a transcendental pass. On a GPU the same chains would be several memory-bound
kernels instead of one, so only float32 / float64 CPU tensors take them (``transcendental_bound``);
half-precision inputs keep the kernels that compute in float32 internally.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_TWO_C = 2 * math.sqrt(2 / math.pi)  # tanh-GELU's 2 sqrt(2/pi)
_CUBIC = 0.044715


def transcendental_bound(x: Tensor) -> bool:
    """``x``'s elementwise kernels cost more in exp / tanh than in memory passes (a float32 / float64
    CPU tensor)."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64)


def gelu_tanh_one_sigmoid(x: Tensor) -> Tensor:
    """tanh-GELU of ``x`` [..., f] as x * sigmoid(2c (x + a x^3)): one new tensor, the output, worked on in
    place (not for autograd to differentiate)."""
    out = x * x
    out.mul_(_TWO_C * _CUBIC).add_(_TWO_C).mul_(x)
    return out.sigmoid_().mul_(x)


def gelu_tanh_one_sigmoid_differentiable(x: Tensor) -> Tensor:
    """The same, the same operations in the same order, out of place: for autograd and compiled regions
    (where inductor fuses them into one pass)."""
    return torch.sigmoid((x * x * (_TWO_C * _CUBIC) + _TWO_C) * x) * x


def swiglu_grad_one_sigmoid(grad: Tensor, y: Tensor) -> Tensor:
    """d (silu(y1) * y2) / dy of y = [y1, y2] [..., 2f] given ``grad`` [..., f] -> [..., 2f].

    With s = sigmoid(y1) and a = silu(y1) = y1 s: d y2 = grad a, d y1 = grad y2 silu'(y1), where
    silu'(y1) = s (1 + y1 (1 - s)) = s - a s + a. Written into the two halves of one new tensor."""
    y1, y2 = y.chunk(2, dim=-1)
    d_y = torch.empty_like(y, memory_format=torch.contiguous_format)
    d_gate, d_up = d_y.chunk(2, dim=-1)
    torch.sigmoid(y1, out=d_gate)
    torch.mul(y1, d_gate, out=d_up)  # a
    d_gate.addcmul_(d_up, d_gate, value=-1).add_(d_up)  # s - a s + a
    d_gate.mul_(grad).mul_(y2)
    d_up.mul_(grad)
    return d_y
