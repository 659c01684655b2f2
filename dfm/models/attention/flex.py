"""The ``flex`` backend: one FlexAttention call per pack with a document block mask."""

from __future__ import annotations

import functools

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

from dfm.models.attention.segments import cached_per_pack, document_ids_on_device, query_is_real


@functools.lru_cache(maxsize=2)
def _flex_attention_for(on_cuda: bool):
    """Compiled where the tensors are on CUDA (eager flex is a slow reference there); eager on the CPU."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True) if on_cuda else flex_attention


def document_block_mask(params: PackedSeqParams, sq: int, sk: int, device: torch.device):
    """The FlexAttention BlockMask of this pack: each real query sees its own sample's keys."""

    def build():
        from torch.nn.attention.flex_attention import create_block_mask

        q_doc = document_ids_on_device(params, "q", sq, device)
        kv_doc = document_ids_on_device(params, "kv", sk, device)

        def same_sample(b, h, q_idx, kv_idx):
            return (q_doc[q_idx] == kv_doc[kv_idx]) & (q_doc[q_idx] >= 0)

        return create_block_mask(same_sample, B=None, H=None, Q_LEN=sq, KV_LEN=sk, device=device)

    return cached_per_pack(params, "flex_mask", (sq, sk, device), build)


def flex_document_attention(query: Tensor, key: Tensor, value: Tensor, params: PackedSeqParams, scale: float) -> Tensor:
    """Same contract as :func:`sdpa_per_segment`, one FlexAttention call with a document mask."""
    mask = document_block_mask(params, query.shape[0], key.shape[0], query.device)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    out = _flex_attention_for(q.is_cuda)(q, k, v, block_mask=mask, scale=scale).permute(2, 0, 1, 3)
    # Rows with no allowed key (padding) are undefined in flex; zero them as the reference does.
    return out * query_is_real(params, query.shape[0], query.device).to(out.dtype)
