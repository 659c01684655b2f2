"""What a pack costs to train, up to a constant factor: its linear FLOPs plus its attention FLOPs.

Per transformer block a token costs about ``(12 h + 4 ffn) h`` FLOPs in linear layers (qkv and out
projections 8 h^2, cross-attention query and out 4 h^2, the MLP's two matmuls 4 h ffn) and every
pair of tokens of one sample ``4 h`` in self-attention (see ``dfm/models/dit/dit_flops.py``). Divided
by ``4 h``: a pack of samples of lengths ``s_i`` costs ``linear * sum(s_i) + sum(s_i ** 2)`` with
``linear = 3 h + ffn``. Two packs of equal token count can then differ several-fold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_WIDTH = 4096


@dataclass(frozen=True)
class PackCost:
    linear: float = 3 * DEFAULT_WIDTH + 4 * DEFAULT_WIDTH  # per token, in units of one token pair's attention

    def __post_init__(self) -> None:
        if self.linear <= 0:
            raise ValueError(f"PackCost.linear must be positive, got {self.linear}")

    @classmethod
    def for_width(cls, hidden_size: int, ffn_hidden_size: int | None = None) -> PackCost:
        ffn = ffn_hidden_size if ffn_hidden_size is not None else 4 * hidden_size
        return cls(linear=float(3 * hidden_size + ffn))

    def sample(self, length: int) -> float:
        return self.linear * length + float(length) ** 2

    def pack(self, lengths: Sequence[int]) -> float:
        return sum(self.sample(n) for n in lengths)
