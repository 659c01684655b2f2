"""adaLN(-Zero) conditioning: per-sample vectors become shift / scale / gate rows, one per sample.

The blocks keep them as rows (``AdaLNRows``, row_modulation.py: tokens take their row inside the
ops); the final layers and embedders gather them to tokens (``rows_to_tokens``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region
from megatron.core.transformer.module import MegatronModule
from torch import Tensor, nn

from dfm.models.common.dtypes import accumulation_dtype, as_dtype
from dfm.models.common.init import zero_init
from dfm.models.common.one_rank_linear import LocalColumnLinear


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return x * (1 + scale) + shift


def sum_rows_by_one_hot_gemm(grad: Tensor, ids: Tensor, num_rows: int) -> Tensor:
    """[s, k] -> [N, k]: row n sums the grads of the tokens with id n, as a one-hot [N, s] GEMM."""
    one_hot = ids[None, :] == torch.arange(num_rows, device=ids.device)[:, None]
    return one_hot.to(grad.dtype) @ grad


def sum_rows_by_index_add(grad: Tensor, ids: Tensor, num_rows: int) -> Tensor:
    """Same sums by index_add_ in fp32, or fp64 for fp64 grads (deterministic on the CPU, in token order)."""
    acc = accumulation_dtype(grad)
    sums = torch.zeros(num_rows, grad.shape[1], dtype=acc, device=grad.device)
    return as_dtype(sums.index_add_(0, ids, as_dtype(grad, acc)), grad.dtype)


class _RowsToTokens(torch.autograd.Function):
    """Gather forward; backward sums each row's token grads (see ``rows_to_tokens``)."""

    @staticmethod
    def forward(ctx, rows: Tensor, token_row_ids: Tensor) -> Tensor:
        ctx.save_for_backward(token_row_ids)
        ctx.num_rows = rows.shape[0]
        return rows.index_select(0, token_row_ids)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        (ids,) = ctx.saved_tensors
        sum_rows = sum_rows_by_one_hot_gemm if grad.is_cuda else sum_rows_by_index_add
        return sum_rows(grad.contiguous(), ids, ctx.num_rows), None


def rows_to_tokens(rows: Tensor, token_row_ids: Tensor) -> Tensor:
    """rows [N, k], token_row_ids [s] -> [s, k], token i taking row ``token_row_ids[i]``.

    Same values as ``rows[token_row_ids]``; only the backward differs. A gather's backward
    (index_put with accumulate) sorts the ids and serialises thousands of adds into the same few
    rows on CUDA: 16.6% of a step at 8k tokens per sample (docs/performance.md). Here CUDA sums
    by a one-hot GEMM (2*N*s*k FLOPs, deterministic, tensor cores); the CPU by index_add_, which
    measured fastest there (a one-hot GEMM 1.6-3x slower, segment_reduce 20-60x).
    """
    return _RowsToTokens.apply(rows, token_row_ids)


def _zeros(weight: Tensor) -> None:
    nn.init.zeros_(weight)


class ModulationLinear(LocalColumnLinear):
    """The adaLN projection's linear: its products stay in the run's precision under ``mixed_precision.fp8``
    (one row per sample, so few FLOPs, and every token's shift, scale and gate come from it)."""

    fp8_capable = False


class AdaLNModulation(MegatronModule):
    """cond [N, h] -> [N, num_chunks * h] (``rows``): the modulation, one row per sample.

    The projection runs once per sample (not per token), so packing many samples costs one small
    matmul; the blocks take the rows as they are (``AdaLNRows``). Zero-initialised: a fresh block is
    the identity.
    """

    def __init__(self, config, num_chunks: int):
        super().__init__(config=config)
        self.num_chunks = num_chunks
        rank = getattr(config, "adaln_lora_dim", None)
        # Low-rank adaLN (Cosmos / NeMo's DiT-7B): h -> rank, replicated and tiny, then rank -> chunks x h;
        # 7 rank h parameters per block instead of 6 h^2.
        self.down = nn.Linear(config.hidden_size, rank, bias=False) if rank else None
        self.linear = ModulationLinear(
            rank or config.hidden_size,
            num_chunks * config.hidden_size,
            config=config,
            init_method=_zeros,
            bias=True,
            gather_output=True,
        )
        zero_init(self.linear)
        # The input is one row per sample, not a sequence: never all-gather it over SP ranks.
        self.linear.sequence_parallel = False

    def rows(self, cond: Tensor) -> Tensor:
        """cond [N, h] -> [N, num_chunks * h], one row per sample."""
        hidden = F.silu(cond)
        per_sample, _ = self.linear(hidden if self.down is None else self.down(hidden))
        if self.config.sequence_parallel:
            # Each TP rank modulates only its slice of the tokens: sum their grads over TP ranks
            # before the column-parallel gather hands each rank its partition's grad.
            per_sample = copy_to_tensor_model_parallel_region(per_sample)
        return per_sample


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
