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


def rotate(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """RoPE of x [s, b, np, d] by cos / sin [s, 1, 1, d]: x * cos + rotate_half(x) * sin."""
    return x * cos + rotate_half(x, interleaved) * sin


def rotate_transposed(grad: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """The backward of ``rotate`` (rotate_half is antisymmetric: its transpose is minus itself)."""
    return grad * cos - rotate_half(grad * sin, interleaved)
