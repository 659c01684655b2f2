"""The dtypes hand-written backward passes compute in."""

from __future__ import annotations

import torch
from torch import Tensor


def accumulation_dtype(x: Tensor) -> torch.dtype:
    """Backward's precision: at least fp32 (fp64 stays fp64: the gradient checks)."""
    return torch.promote_types(x.dtype, torch.float32)


def as_dtype(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x in ``dtype``: x itself when it already is. A no-op ``Tensor.to`` still costs ~0.7 us a call on
    the CPU, and the block's backwards make ~100 of them a step when everything is fp32 already."""
    return x if x.dtype == dtype else x.to(dtype)
