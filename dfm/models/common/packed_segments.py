"""Attention segments built from host cu_seqlens: one device copy, the host one kept alongside."""

from __future__ import annotations

from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

from dfm.data.packed_batch import segment_lengths
from dfm.models.attention.segments import PackedSegments


def packed_segments(cu_q: Tensor, cu_q_padded: Tensor, cu_kv: Tensor, cu_kv_padded: Tensor, device) -> PackedSegments:
    """Segments over host cu_seqlens [N+1] int32 (real and padded, query and key side) on ``device``,
    their host copy as ``host`` (loops over segments read it without a device sync); the max
    sequence lengths are the real ones'."""
    max_q, max_kv = int(segment_lengths(cu_q).max()), int(segment_lengths(cu_kv).max())

    def segments(on) -> PackedSeqParams:
        return PackedSeqParams(
            qkv_format="sbhd",
            cu_seqlens_q=cu_q.to(on),
            cu_seqlens_q_padded=cu_q_padded.to(on),
            cu_seqlens_kv=cu_kv.to(on),
            cu_seqlens_kv_padded=cu_kv_padded.to(on),
            max_seqlen_q=max_q,
            max_seqlen_kv=max_kv,
        )

    params = PackedSegments(**vars(segments(device)))
    params.host = segments("cpu")
    return params
