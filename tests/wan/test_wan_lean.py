"""Wan's q / k norm across heads (+ RoPE) Functions (dfm/models/wan/qk_norm.py) against the unfused ops
they replace: float64 gradcheck, equal forward / backward, bitwise equal fp32 forward, the heads split
over ranks as under TP, and what a bf16 call keeps for backward."""

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

from dfm.models.attention.rope_tables import RotaryTables
from dfm.models.wan.qk_norm import across_heads_norm_rope, square_sum
from tests.models.test_lean_block import assert_same_grads, rand

HEADS, HEAD_DIM, EPS = 3, 4, 1e-6
ROPE = {"no_rope": None, "rope": False, "rope_interleaved": True}


def tables(tokens: int, interleaved: bool | None) -> RotaryTables | None:
    angles = torch.rand(tokens, 1, 1, HEAD_DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) * 6
    return None if interleaved is None else RotaryTables(angles, interleaved)


def unfused(x, weight, rotary: RotaryTables | None):
    """The block before: AcrossHeadsRMSNorm's ops, then megatron's RoPE."""
    squares = x.pow(2).sum(dim=(-2, -1), keepdim=True)
    normed = (x * torch.rsqrt(squares / (HEADS * HEAD_DIM) + EPS)).to(x.dtype) * weight.view(-1, HEAD_DIM)
    if rotary is None:
        return normed
    return _apply_rotary_pos_emb_bshd(normed, rotary.angles.to(x.dtype), rotary_interleaved=rotary.interleaved)


def fused(x, weight, rotary: RotaryTables | None):
    cos, sin = (None, None) if rotary is None else rotary.cos_sin(x.dtype)
    variance = square_sum(x) / (HEADS * HEAD_DIM) + EPS
    return across_heads_norm_rope(x, variance, weight, cos, sin, rotary is not None and rotary.interleaved)


@pytest.mark.parametrize("interleaved", list(ROPE.values()), ids=list(ROPE))
def test_across_heads_norm_rope_equals_the_unfused_norm_then_megatron_rope(interleaved):
    inputs = (rand(5, 2, HEADS, HEAD_DIM), rand(HEADS * HEAD_DIM, seed=1), tables(5, interleaved))
    assert_same_grads(fused, unfused, inputs)


@pytest.mark.parametrize("interleaved", list(ROPE.values()), ids=list(ROPE))
def test_each_function_passes_gradcheck(interleaved):
    rotary = tables(5, interleaved)
    cos, sin = (None, None) if rotary is None else rotary.cos_sin(torch.float64)
    variance = (torch.rand(5, 2, 1, 1, dtype=torch.float64) + 0.5).requires_grad_()
    x, weight = rand(5, 2, HEADS, HEAD_DIM), rand(HEADS * HEAD_DIM, seed=1)
    assert torch.autograd.gradcheck(across_heads_norm_rope, (x, variance, weight, cos, sin, bool(interleaved)))
    assert torch.autograd.gradcheck(square_sum, (x,))


def test_heads_split_over_ranks_with_summed_squares_equal_the_whole():
    """Under TP each rank norms its heads with the all-reduced sum of squares (norms.py); in one graph
    the sum's backward hands each rank's partial gradient to both halves, as the all-reduce does."""
    x, weight, rotary = rand(5, 1, 4, HEAD_DIM), rand(4 * HEAD_DIM, seed=1), tables(5, True)
    cos, sin = rotary.cos_sin(torch.float64)

    def split(x, weight):
        halves, weights = x.chunk(2, dim=2), weight.chunk(2)
        variance = sum(square_sum(half) for half in halves) / x[0].numel() + EPS
        return torch.cat([across_heads_norm_rope(h, variance, w, cos, sin, True) for h, w in zip(halves, weights)], 2)

    def whole(x, weight):
        return across_heads_norm_rope(x, square_sum(x) / x[0].numel() + EPS, weight, cos, sin, True)

    assert_same_grads(split, whole, (x, weight))


@pytest.mark.parametrize("interleaved", list(ROPE.values()), ids=list(ROPE))
def test_fp32_forward_is_bitwise_the_unfused_ops(interleaved):
    x, weight = rand(7, 1, HEADS, HEAD_DIM).detach().float(), rand(HEADS * HEAD_DIM, seed=1).detach().float()
    rotary = tables(7, interleaved)
    if rotary is not None:
        rotary = RotaryTables(rotary.angles.float(), rotary.interleaved)
    assert torch.equal(fused(x, weight, rotary), unfused(x, weight, rotary))


def test_a_bf16_call_keeps_its_input_and_the_variance_only():
    """Unfused, autograd kept fp32 copies of x, the normed and the weighted q (for RoPE) too."""
    x = torch.randn(16, 1, HEADS, HEAD_DIM, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.ones(HEADS * HEAD_DIM, dtype=torch.bfloat16, requires_grad=True)
    saved = {}
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.setdefault(t.untyped_storage().data_ptr(), t), id):
        fused(x, weight, None)
    saved.pop(weight.untyped_storage().data_ptr())
    assert sum(t.untyped_storage().nbytes() for t in saved.values()) == x.numel() * 2 + 16 * 4
