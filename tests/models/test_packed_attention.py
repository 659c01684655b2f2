"""THD packed attention: sdpa (per segment), flex (document mask) and varlen (flash's cu_seqlens
boundaries, checked here through a reference kernel with the same contract; the real kernel in the
gpu-marked test) agree with a dense masked reference, for self- and cross-attention with different
text lengths and padded segments."""

import functools

import pytest
import torch
import torch.nn.functional as F

from dfm.models.attention import flex_document_attention, sdpa_per_segment, varlen
from dfm.models.attention.varlen import VarlenSegments, varlen_document_attention
from tests.models._helpers import segments, segments_on


def reference_varlen_attn(query, key, value, segments, scale):
    """What torch's varlen flash kernel computes: q [t, h, d] segment j attends to k segment j;
    empty segments give nothing (a query segment without keys gives zeros)."""
    cu_q, cu_k, max_q, max_k = segments.cu_q, segments.cu_k, segments.max_q, segments.max_k
    out = torch.zeros_like(query)
    bounds = zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist())
    for q0, q1, k0, k1 in bounds:
        assert q1 - q0 <= max_q and k1 - k0 <= max_k
        if q1 > q0 and k1 > k0:
            q, k, v = (t.transpose(0, 1) for t in (query[q0:q1], key[k0:k1], value[k0:k1]))
            out[q0:q1] = F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(0, 1)
    return out


KERNELS = {
    "sdpa": sdpa_per_segment,
    "flex": flex_document_attention,
    "varlen": functools.partial(varlen_document_attention, attn=reference_varlen_attn),
}
HEADS, HEAD_DIM = 2, 8


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
    # uniform packs (varlen runs them as one batched SDPA call): same-size images; padded queries, whole keys
    "uniform_self": ([6, 6, 6], [6, 6, 6], [6, 6, 6], [6, 6, 6]),
    "uniform_cross_padded_queries": ([5, 5], [8, 8], [4, 4], [4, 4]),
}
UNIFORM = {"uniform_self", "uniform_cross_padded_queries"}


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


def test_varlen_pads_head_dims_the_flash_kernel_cannot_take(monkeypatch):
    """Head dim 12: torch's kernel (here a stand-in that, like flash, refuses dims that are no multiple
    of 8) sees 16 zero-padded channels; the result is exact attention at dim 12, gradients included."""

    def flash_like(query, key, value, *bounds, scale=None):  # bounds: cu_q, cu_k, max_q, max_k
        assert query.shape[-1] % 8 == 0, "head_size must be a multiple of 8"
        return reference_varlen_attn(query, key, value, VarlenSegments(*bounds), scale)

    monkeypatch.setattr("torch.nn.attention.varlen.varlen_attn", flash_like)
    q_lens, q_padded, kv_lens, kv_padded = CASES["cross_padded_text"]
    params = segments(q_lens, q_padded, kv_lens, kv_padded)
    gen = torch.Generator().manual_seed(0)
    inputs = [
        torch.randn(sum(n), 1, HEADS, 12, generator=gen, requires_grad=True) for n in (q_padded, kv_padded, kv_padded)
    ]
    out = varlen_document_attention(*inputs, params, 0.3)
    expected = dense_reference(*inputs, params, 0.3)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), inputs)
    for got, want in zip(grads, torch.autograd.grad(expected.square().sum(), inputs)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_varlen_runs_uniform_packs_as_one_batched_sdpa_call(case, monkeypatch):
    """A pack with one segment length per side and no key padding takes ``batched_sdpa`` (SDPA runs on
    the CPU too: checked here against the dense reference, gradients included); any other takes torch's
    varlen kernel (CUDA only: a stand-in records the call)."""
    q_lens, q_padded, kv_lens, kv_padded = CASES[case]
    params = segments(q_lens, q_padded, kv_lens, kv_padded)
    calls = []
    monkeypatch.setattr(varlen, "torch_varlen_attn", lambda *a: calls.append(1) or reference_varlen_attn(*a))
    gen = torch.Generator().manual_seed(0)
    inputs = [
        torch.randn(sum(n), 1, HEADS, HEAD_DIM, generator=gen, requires_grad=True)
        for n in (q_padded, kv_padded, kv_padded)
    ]
    out = varlen.varlen_document_attention(*inputs, params, 0.3)
    assert varlen.varlen_segments(params, sum(q_padded), sum(kv_padded), out.device).uniform == (case in UNIFORM)
    assert calls == ([] if case in UNIFORM else [1])
    expected = dense_reference(*inputs, params, 0.3)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for got, want in zip(
        torch.autograd.grad(out.square().sum(), inputs), torch.autograd.grad(expected.square().sum(), inputs)
    ):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("head_dim", [64, 12])
@pytest.mark.parametrize("case", list(CASES))
def test_varlen_flash_matches_per_segment_sdpa_bf16(case, head_dim):
    """torch's varlen flash kernel (batched SDPA on the uniform cases) vs per-segment SDPA, forward and
    backward, bf16, at head dim 64 and at 12 (no multiple of 8: zero-padded for the kernel, as the tiny
    Wan configs need)."""
    q_lens, q_padded, kv_lens, kv_padded = CASES[case]
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = dict(device="cuda", dtype=torch.bfloat16)
    query = torch.randn(sum(q_padded), 1, 4, head_dim, generator=gen, **shape)
    key, value = torch.randn(2, sum(kv_padded), 1, 4, head_dim, generator=gen, **shape)
    outputs, grads = [], []
    for kernel in (varlen_document_attention, sdpa_per_segment):
        params = segments_on("cuda", q_lens, q_padded, kv_lens, kv_padded)
        inputs = [t.clone().requires_grad_() for t in (query, key, value)]
        out = kernel(*inputs, params, head_dim**-0.5)
        out.float().square().sum().backward()
        outputs.append(out.float())
        grads.append([t.grad.float() for t in inputs])
    torch.testing.assert_close(outputs[0], outputs[1], atol=2e-2, rtol=2e-2)
    for varlen_grad, sdpa_grad in zip(*grads):
        torch.testing.assert_close(varlen_grad, sdpa_grad, atol=5e-2, rtol=5e-2)
