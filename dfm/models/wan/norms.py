"""Wan's normalisations: q/k RMSNorm over all heads of a token (+ RoPE), under tensor parallelism too."""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint
from torch import Tensor, nn

from dfm.models.attention.rope_tables import RotaryTables
from dfm.models.wan.qk_norm import across_heads_norm_rope, square_sum


def sum_over_tensor_parallel_ranks(partial: Tensor) -> Tensor:
    """All-reduce over TP in the forward and in the backward: every rank's outputs depend on the
    sum, so each rank's gradient of it is partial too."""
    return copy_to_tensor_model_parallel_region(reduce_from_tensor_model_parallel_region(partial))


class AcrossHeadsRMSNorm(nn.Module):
    """RMSNorm of a token's queries (or keys) over ALL heads together (diffusers'
    ``qk_norm="rms_norm_across_heads"``), as megatron's q/k layernorm: x [s, b, np, hn].

    Under TP a rank holds np / tp heads: the sum of squares is all-reduced over the TP group, and
    the weight [np / tp * hn] is this rank's shard of the full [np * hn] one (partition dim 0).
    """

    def __init__(self, hidden_size: int, config, eps: float = 1e-6):
        super().__init__()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.head_dim, self.eps = hidden_size, eps
        self.full_dim = config.num_attention_heads * hidden_size
        self.weight = nn.Parameter(torch.ones(self.full_dim // tp, dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)
        self.tensor_parallel = tp > 1

    def forward(self, x: Tensor, rotary: RotaryTables | None = None) -> Tensor:
        """x [s, b, np, hn] -> the same shape, rotated by ``rotary`` (self-attention's RoPE) if given.
        Keeps x and the per-token variance for backward (qk_norm.py)."""
        squares = square_sum(x)
        if self.tensor_parallel:
            squares = sum_over_tensor_parallel_ranks(squares)
        cos, sin = (None, None) if rotary is None else rotary.cos_sin(x.dtype)
        interleaved = rotary is not None and rotary.interleaved
        return across_heads_norm_rope(x, squares / self.full_dim + self.eps, self.weight, cos, sin, interleaved)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The weight as a TP shard along dim 0 (megatron takes a plain module's tensors as replicated)."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(
            state,
            prefix,
            {"weight": 0},
            sharded_offsets,
            tp_group=parallel_state.get_tensor_model_parallel_group(),
            dp_cp_group=metadata["dp_cp_group"],
        )


class SequenceParallelLayerNorm(nn.LayerNorm):
    """Affine LayerNorm (Wan's cross-attention ``norm2``). Under sequence parallelism each TP rank
    normalises its own tokens, so megatron must all-reduce these weights' grads over TP
    (it does for parameters marked ``sequence_parallel``)."""

    def __init__(self, hidden_size: int, eps: float, sequence_parallel: bool):
        super().__init__(hidden_size, eps=eps)
        for param in self.parameters():
            param.sequence_parallel = sequence_parallel
