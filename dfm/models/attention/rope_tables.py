"""RoPE cos / sin computed once per pack and shared by every layer (megatron recomputes and keeps them
per layer, for queries and keys apart: four [s, 1, 1, d] tensors saved per layer).

``RotaryTables`` wraps the angles [s, 1, 1, d] of ``rope_3d_freqs``; cos and sin are made on first use
in each dtype (the dtype of the queries, as megatron casts them) and cached for the pack.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class RotaryTables:
    """angles [s, 1, 1, d]; ``interleaved``: rotate channel pairs (2i, 2i+1) instead of halves."""

    angles: Tensor
    interleaved: bool = False
    cache: dict[torch.dtype, tuple[Tensor, Tensor]] = field(default_factory=dict, repr=False)

    def cos_sin(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(cos, sin) [s, 1, 1, d] in ``dtype``, rounded as megatron rounds them (in fp32, then cast)."""
        if dtype not in self.cache:
            self.cache[dtype] = (self.angles.cos().to(dtype), self.angles.sin().to(dtype))
        return self.cache[dtype]


def rotate_half(x: Tensor, interleaved: bool) -> Tensor:
    """[..., d] -> (-x2, x1) on halves, or on channel pairs when ``interleaved`` (megatron's ``_rotate_half``)."""
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


# From this many elements a rotation is written channel set by channel set into one output: the unfused
# formula's five full-size temporaries are each, on the CPU from 4 MiB, a fresh mapping faulted in on first
# touch (dfm/platform/host_memory.py). Measured on [4096, 1, 4, 64] fp32 (2026-11-29): 5.7 -> 3.0 ms
# forward, 5.2 -> 2.5 ms transposed; below ~256k elements the extra calls cost more than they save.
WRITTEN_BY_CHANNEL_SET = 1 << 18


def _pair(t: Tensor, interleaved: bool) -> tuple[Tensor, Tensor]:
    """The two channel sets RoPE rotates into each other: halves, or even / odd channels."""
    if interleaved:
        return t[..., 0::2], t[..., 1::2]
    half = t.shape[-1] // 2
    return t[..., :half], t[..., half:]


def _rotate_by_channel_set(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, transposed: bool) -> Tensor:
    """``rotate`` (or, ``transposed``, ``rotate_transposed``) into one output and a half-size scratch:
    out1 = x1 c1 - x2 s1, out2 = x2 c2 + x1 s2 (transposed: x1 c1 + x2 s2, x2 c2 - x1 s1). Each product
    rounded, then the sum: the unfused formula's values, bit for bit."""
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, cos.dtype), device=x.device)
    (x1, x2), (o1, o2), (c1, c2), (s1, s2) = (_pair(t, interleaved) for t in (x, out, cos, sin))
    scratch = torch.empty(o1.shape, dtype=out.dtype, device=out.device)
    torch.mul(x1, c1, out=o1)
    torch.mul(x2, c2, out=o2)
    if transposed:
        o1.add_(torch.mul(x2, s2, out=scratch))
        o2.sub_(torch.mul(x1, s1, out=scratch))
    else:
        o1.sub_(torch.mul(x2, s1, out=scratch))
        o2.add_(torch.mul(x1, s2, out=scratch))
    return out


def rotate(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """RoPE of x [s, b, np, d] by cos / sin [s, 1, 1, d]: x * cos + rotate_half(x) * sin. Large
    inputs are not differentiable this way (``apply_rotary`` is): for use inside autograd Functions."""
    if x.numel() >= WRITTEN_BY_CHANNEL_SET:
        return _rotate_by_channel_set(x, cos, sin, interleaved, transposed=False)
    return x * cos + rotate_half(x, interleaved) * sin


def rotate_transposed(grad: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """The backward of ``rotate`` (rotate_half is antisymmetric: its transpose is minus itself)."""
    if grad.numel() >= WRITTEN_BY_CHANNEL_SET:
        return _rotate_by_channel_set(grad, cos, sin, interleaved, transposed=True)
    return grad * cos - rotate_half(grad * sin, interleaved)


class _Rotary(torch.autograd.Function):
    """``rotate`` with its backward, saving only the tables (shared by the pack's layers)."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.interleaved, ctx.dtype = interleaved, x.dtype
        return rotate(x, cos, sin, interleaved)

    @staticmethod
    def backward(ctx, grad: Tensor):
        cos, sin = ctx.saved_tensors
        return rotate_transposed(grad, cos, sin, ctx.interleaved).to(ctx.dtype), None, None, None


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """Differentiable ``rotate`` of x [s, b, np, d] (tables [s, 1, 1, d], no grad): autograd's own
    nodes for small inputs, one Function (the same values) for large ones."""
    if x.numel() >= WRITTEN_BY_CHANNEL_SET:
        return _Rotary.apply(x, cos, sin, interleaved)
    return rotate(x, cos, sin, interleaved)  # below the threshold: plain ops autograd differentiates
