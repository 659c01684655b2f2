"""adaLN(-Zero) conditioning: per-sample vectors become per-token shift / scale / gate."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, copy_to_tensor_model_parallel_region
from megatron.core.transformer.module import MegatronModule
from torch import Tensor, nn


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return x * (1 + scale) + shift


class _RowsToTokens(torch.autograd.Function):
    """Gather forward, segment sum backward (see ``rows_to_tokens``)."""

    @staticmethod
    def forward(ctx, rows: Tensor, token_row_ids: Tensor) -> Tensor:
        ctx.save_for_backward(token_row_ids)
        ctx.num_rows = rows.shape[0]
        return rows.index_select(0, token_row_ids)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        (ids,) = ctx.saved_tensors
        counts = torch.zeros(ctx.num_rows, dtype=torch.long, device=ids.device).index_add_(0, ids, torch.ones_like(ids, dtype=torch.long))
        # unsafe=True skips the checks that read ``counts`` back on the host (a device sync);
        # fp32 so 64k bf16 token grads add up without losing the small ones.
        summed = torch.segment_reduce(grad.float(), "sum", lengths=counts, axis=0, unsafe=True)
        return summed.to(grad.dtype), None


def rows_to_tokens(rows: Tensor, token_row_ids: Tensor) -> Tensor:
    """rows [N, k], token_row_ids [s] (non-decreasing) -> [s, k], token i taking row ``token_row_ids[i]``.

    Same values as ``rows[token_row_ids]``, but the backward sums each row's contiguous run of
    token grads (a segmented reduction) instead of scattering them with a gather's backward,
    which on CUDA serialises thousands of adds into the same few rows (16.6% of a step at 8k
    tokens per sample, docs/performance.md). THD packs, their SP slices and their CP chunks all
    keep each sample's tokens contiguous and in sample order, which is all this needs.
    """
    return _RowsToTokens.apply(rows, token_row_ids)


def _zeros(weight: Tensor) -> None:
    nn.init.zeros_(weight)


class AdaLNModulation(MegatronModule):
    """cond [N, h] -> ``num_chunks`` tensors [s, 1, h], each token taking its own sample's row.

    The projection runs once per sample (not per token), then rows are gathered to tokens,
    so packing many samples costs one small matmul. Zero-initialised: a fresh block is the identity.
    """

    def __init__(self, config, num_chunks: int):
        super().__init__(config=config)
        self.num_chunks = num_chunks
        self.linear = ColumnParallelLinear(
            config.hidden_size,
            num_chunks * config.hidden_size,
            config=config,
            init_method=_zeros,
            bias=True,
            gather_output=True,
        )
        # The input is one row per sample, not a sequence: never all-gather it over SP ranks.
        self.linear.sequence_parallel = False

    def forward(self, cond: Tensor, token_sample_ids: Tensor) -> tuple[Tensor, ...]:
        """cond [N, h], token_sample_ids [s] -> num_chunks x [s, 1, h]."""
        per_sample, _ = self.linear(F.silu(cond))
        if self.config.sequence_parallel:
            # Each TP rank modulates only its slice of the tokens: sum their grads over TP ranks
            # before the column-parallel gather hands each rank its partition's grad.
            per_sample = copy_to_tensor_model_parallel_region(per_sample)
        per_token = rows_to_tokens(per_sample, token_sample_ids).unsqueeze(1)
        return per_token.chunk(self.num_chunks, dim=-1)


class AdaLNNorm(nn.LayerNorm):
    """LayerNorm without affine parameters: adaLN supplies scale and shift."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps=eps, elementwise_affine=False)


class AdaLNRMSNorm(nn.RMSNorm):
    """RMSNorm without affine parameters (Llama-style blocks): adaLN supplies scale and shift."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps=eps, elementwise_affine=False)


class QKRMSNorm(nn.RMSNorm):
    """RMSNorm on each head's queries or keys (megatron builds it with hidden_size=head dim)."""

    def __init__(self, hidden_size: int, config=None, eps: float = 1e-6):
        super().__init__(hidden_size, eps=eps)
