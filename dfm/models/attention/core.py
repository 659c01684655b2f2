"""The one interface every local backend plugs into: megatron's ``core_attention`` submodule
over THD packs; ``backend`` names the kernel (sdpa.py, flex.py, varlen.py), all
``(q, k, v, params, scale) -> out`` on [s, b, np, hn]. Transformer Engine has its own module (te.py).
"""

from __future__ import annotations

import functools

import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

import dfm.models.attention as kernels
from dfm.models.attention.segments import attend_in_segment_order


class PackedDotProductAttention(MegatronModule):
    """megatron ``core_attention`` for packed samples; ``backend`` picks the kernel.

    megatron also passes ``attn_mask_type``, ``attention_dropout``, ``cp_comm_type`` and
    ``pg_collection``: packs carry their own masks and CP plan, so they are not read."""

    def __init__(
        self,
        config,
        layer_number: int,
        attention_type: str = "self",
        softmax_scale: float | None = None,
        backend: str = "sdpa",
        **megatron_kwargs,
    ):
        super().__init__(config=config)
        self.backend = backend
        self.kernel = kernels.kernel_for(backend)
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else head_dim**-0.5

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None = None,
        attn_mask_type=None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        """query [sq, b, np, hn], key/value [sk, b, np, hn] -> [sq, b, np*hn]."""
        if packed_seq_params is None:
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out = F.scaled_dot_product_attention(q, k, v, scale=self.softmax_scale).permute(2, 0, 1, 3)
            return out.reshape(out.shape[0], out.shape[1], -1)
        kernel = functools.partial(attend_in_segment_order, self.kernel, scale=self.softmax_scale)
        context_parallel = getattr(packed_seq_params, "context_parallel", None)
        if context_parallel is not None:
            out = context_parallel(kernel, query, key, value)
        else:
            out = kernel(query, key, value, packed_seq_params)
        return out.reshape(out.shape[0], out.shape[1], -1)
