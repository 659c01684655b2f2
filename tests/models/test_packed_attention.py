"""THD packed attention: sdpa (per segment) and flex (document mask) agree with a dense masked
reference, for self- and cross-attention with different text lengths and padded segments."""

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from dfm.models.common.packed_attention import flex_document_attention, sdpa_per_segment

KERNELS = {"sdpa": sdpa_per_segment, "flex": flex_document_attention}
HEADS, HEAD_DIM = 2, 8


def cumulative(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def segments(q_lens, q_padded, kv_lens, kv_padded) -> PackedSeqParams:
    return PackedSeqParams(
        qkv_format="sbhd",
        cu_seqlens_q=cumulative(q_lens),
        cu_seqlens_q_padded=cumulative(q_padded),
        cu_seqlens_kv=cumulative(kv_lens),
        cu_seqlens_kv_padded=cumulative(kv_padded),
    )


def dense_reference(query, key, value, params, scale):
    """One softmax over the whole pack with a block-diagonal mask of real tokens."""

    def doc_ids(side, total):
        ids = torch.full((total,), -1)
        starts = getattr(params, f"cu_seqlens_{side}_padded")[:-1].tolist()
        lengths = torch.diff(getattr(params, f"cu_seqlens_{side}")).tolist()
        for index, (start, length) in enumerate(zip(starts, lengths)):
            ids[start : start + length] = index
        return ids

    q_doc, kv_doc = doc_ids("q", query.shape[0]), doc_ids("kv", key.shape[0])
    allowed = (q_doc[:, None] == kv_doc[None]) & (q_doc[:, None] >= 0)
    scores = torch.einsum("qbhd,kbhd->bhqk", query, key) * scale
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)
    return torch.einsum("bhqk,kbhd->qbhd", probs, value)


CASES = {
    # name: (q real lengths, q padded lengths, kv real lengths, kv padded lengths)
    "self_padded": ([5, 9, 3], [8, 12, 4], [5, 9, 3], [8, 12, 4]),
    "cross_text_lengths": ([5, 9, 3], [8, 12, 4], [2, 7, 4], [2, 7, 4]),
    "cross_padded_text": ([6, 1, 10], [6, 4, 10], [3, 5, 1], [4, 8, 2]),
}


@pytest.mark.parametrize("backend", list(KERNELS))
@pytest.mark.parametrize("case", list(CASES))
def test_backends_match_dense_reference(backend, case):
    q_lens, q_padded, kv_lens, kv_padded = CASES[case]
    params = segments(q_lens, q_padded, kv_lens, kv_padded)
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(sum(q_padded), 1, HEADS, HEAD_DIM, generator=gen)
    key, value = torch.randn(2, sum(kv_padded), 1, HEADS, HEAD_DIM, generator=gen)
    out = KERNELS[backend](query, key, value, params, HEAD_DIM**-0.5)
    torch.testing.assert_close(out, dense_reference(query, key, value, params, HEAD_DIM**-0.5), atol=1e-5, rtol=1e-5)
    padding = params.cu_seqlens_q_padded[:-1] + torch.diff(params.cu_seqlens_q)
    for start, end in zip(padding.tolist(), params.cu_seqlens_q_padded[1:].tolist()):
        assert torch.count_nonzero(out[start:end]) == 0  # padding rows attend to nothing
