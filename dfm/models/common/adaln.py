"""adaLN(-Zero) conditioning: per-sample vectors become per-token shift / scale / gate."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, copy_to_tensor_model_parallel_region
from megatron.core.transformer.module import MegatronModule
from torch import Tensor, nn


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return x * (1 + scale) + shift


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
        per_token = per_sample[token_sample_ids].unsqueeze(1)
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
