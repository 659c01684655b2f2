"""Where a pack's q / k / v rows lie in memory.

megatron's layout is [s, b, np, d]; made from a fused QKV output, each head's rows are strided by all
the heads. SDPA's CPU flash kernel reads q / k / v whose heads' rows lie back to back ([b, np, s, d]
memory, "heads-major") faster: on digits-video's self-attention the forward ~10 %, the backward ~6 %
(docs/performance.md). Tensors dfm makes anyway (normed or rotated q / k, the value's copy) are made
heads-major on the CPU and handed on as [s, b, np, d] views; other devices' kernels take megatron's layout.
"""

from __future__ import annotations

from torch import Tensor


def heads_major(x: Tensor) -> Tensor:
    """[s, b, np, d] -> its [b, np, s, d] view."""
    return x.permute(1, 2, 0, 3)


def token_major(x: Tensor) -> Tensor:
    """The inverse view: [b, np, s, d] -> [s, b, np, d]."""
    return x.permute(2, 0, 1, 3)


def made_heads_major(x: Tensor) -> bool:
    """New q / k / v tensors made from x [s, b, np, d] are laid out heads-major (x on the CPU)."""
    return x.device.type == "cpu"


def heads_major_copy(x: Tensor) -> Tensor:
    """x [s, b, np, d] copied into heads-major memory, as an [s, b, np, d] view."""
    return token_major(heads_major(x).contiguous())
