"""The lean DiT block's autograd Functions against the unfused ops they replace: float64 gradcheck
(analytic == numerical gradients) and equal forward / backward to the plain ops, on mixed packs of
several samples (a row no token takes, as on a CP / SP rank) and on a sequence-parallel slice of ids."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

from dfm.models.attention.heads_layout import heads_major, heads_major_copy
from dfm.models.attention.lean_self_attention import LeanSelfAttention
from dfm.models.attention.qk_norm_rope import qk_norm_rope
from dfm.models.attention.rope_tables import WRITTEN_BY_CHANNEL_SET, RotaryTables, apply_rotary, rotate_half
from dfm.models.attention.sdpa_cpu import segment_attention_cpu
from dfm.models.common.adaln import modulate
from dfm.models.common.norm_recompute import norm_modulate_rows, norm_recomputed
from dfm.models.common.row_modulation import gated_residual_rows

H = 6
PACK_IDS = torch.tensor([0, 0, 0, 2, 2, 3, 3, 3, 3, 3, 0])  # 4 samples, row 1 unused; last token: padding
IDS = {"pack": PACK_IDS, "sp_slice": PACK_IDS[4:9]}  # a sequence-parallel rank's tokens, rows whole


def rand(*shape, seed=0):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def assert_same_grads(fused, reference, inputs):
    out_f, out_r = fused(*inputs), reference(*inputs)
    torch.testing.assert_close(out_f, out_r, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(out_r)
    tensors = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    for got, expected in zip(torch.autograd.grad(out_f, tensors, grad), torch.autograd.grad(out_r, tensors, grad)):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(fused, inputs)


@pytest.mark.parametrize("ids", list(IDS.values()), ids=list(IDS))
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_norm_modulate_rows_equals_norm_then_gathered_modulation(ids, rms):
    def reference(x, shift, scale, ids, eps, rms):
        normed = F.rms_norm(x, (H,), eps=eps) if rms else F.layer_norm(x, (H,), eps=eps)
        return modulate(normed, shift[ids].unsqueeze(1), scale[ids].unsqueeze(1))

    inputs = (rand(len(ids), 1, H), rand(4, H, seed=1), rand(4, H, seed=2), ids, 1e-6, rms)
    assert_same_grads(norm_modulate_rows, reference, inputs)


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_norm_recomputed_equals_the_plain_norm(rms):
    def reference(x, eps, rms):
        return F.rms_norm(x, (H,), eps=eps) if rms else F.layer_norm(x, (H,), eps=eps)

    assert_same_grads(norm_recomputed, reference, (rand(11, 1, H), 1e-6, rms))


def test_norm_recomputed_keeps_a_bf16_input_as_is():
    """F.rms_norm on the CPU keeps an fp32 copy of a bf16 input; the Function keeps x and rstd only."""
    x = torch.randn(16, 1, 32, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        norm_recomputed(x, 1e-6, True)
    assert sum(t.numel() * t.element_size() for t in saved) == x.numel() * 2 + 16 * 4


@pytest.mark.parametrize("ids", list(IDS.values()), ids=list(IDS))
@pytest.mark.parametrize("with_bias", [True, False])
def test_gated_residual_rows_equals_gathered_gate(ids, with_bias):
    def reference(x, gate, ids, out, bias):
        return x + gate[ids].unsqueeze(1) * (out if bias is None else out + bias)

    bias = rand(H, seed=3) if with_bias else None
    inputs = (rand(len(ids), 1, H), rand(4, H, seed=1), ids, rand(len(ids), 1, H, seed=2), bias)
    assert_same_grads(gated_residual_rows, reference, inputs)


def test_rows_functions_match_the_unfused_ops_in_fp32_forward_bitwise():
    x, shift, scale, gate, out, bias = (
        t.detach().float() for t in (rand(11, 1, H), *[rand(4, H, seed=s) for s in (1, 2, 3)], rand(11, 1, H), rand(H))
    )
    gathered = [t[PACK_IDS].unsqueeze(1) for t in (shift, scale, gate)]
    for rms, norm in ((False, F.layer_norm), (True, F.rms_norm)):
        expected = modulate(norm(x, (H,), eps=1e-6), gathered[0], gathered[1])
        assert torch.equal(norm_modulate_rows(x, shift, scale, PACK_IDS, 1e-6, rms), expected)
    assert torch.equal(gated_residual_rows(x, gate, PACK_IDS, out, bias), x + gathered[2] * (out + bias))


@pytest.mark.parametrize("rope", [False, True])
def test_qk_norm_rope_on_the_cpu_lays_heads_out_back_to_back_with_the_fused_norms_values(rope):
    """fp32 q / k heads, a strided view of a fused QKV output as in the block: the output's memory is
    [b, np, s, d] (what SDPA's CPU flash kernel reads fastest), its values torch's fused norm's, bit for bit."""
    qkv = torch.randn(300, 2, 3, 3 * 24, generator=torch.Generator().manual_seed(0))
    x, weight = qkv[..., :24], torch.randn(24, generator=torch.Generator().manual_seed(1))
    tables = RotaryTables(torch.rand(300, 1, 1, 24) * 6) if rope else None
    cos, sin = tables.cos_sin(torch.float32) if rope else (None, None)
    out = qk_norm_rope(x, weight, cos, sin, 1e-6, False)
    expected = torch._fused_rms_norm(x, (24,), weight, 1e-6)[0]
    if rope:
        expected = expected * cos + rotate_half(expected, False) * sin
    assert torch.equal(out, expected)
    assert heads_major(out).is_contiguous()


@pytest.mark.parametrize("interleaved", [False, True])
def test_qk_norm_rope_equals_rmsnorm_then_megatron_rope(interleaved):
    tables = RotaryTables(torch.rand(5, 1, 1, 8, dtype=torch.float64) * 6, interleaved)
    cos, sin = tables.cos_sin(torch.float64)

    def reference(x, weight, cos, sin, eps, interleaved):
        normed = F.rms_norm(x, (8,), weight, eps)
        return _apply_rotary_pos_emb_bshd(normed, tables.angles, rotary_interleaved=interleaved)

    inputs = (rand(5, 1, 3, 8), rand(8, seed=1), cos, sin, 1e-6, interleaved)
    assert_same_grads(qk_norm_rope, reference, inputs)
    assert tables.cos_sin(torch.float64)[0] is cos  # made once, shared by every later call


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_rotation_written_by_channel_set_is_megatrons_rope(interleaved, dtype):
    """From ``WRITTEN_BY_CHANNEL_SET`` elements RoPE is written into one output: megatron's values bit
    for bit (a strided view of a fused QKV output, as attention hands it over), and its gradient that of
    the unfused formula's in fp32 (bf16 heads: rounded once from it, where autograd rounds each branch)."""
    heads, dim = 4, 16
    tokens = WRITTEN_BY_CHANNEL_SET // (heads * dim) + 3
    tables = RotaryTables(torch.rand(tokens, 1, 1, dim) * 6, interleaved)
    cos, sin = tables.cos_sin(torch.float32)  # fp32 tables, as FLUX rotates bf16 heads
    fused_qkv = torch.randn(tokens, 1, heads, 3 * dim).to(dtype)
    x = fused_qkv[..., :dim].requires_grad_()
    got = apply_rotary(x, cos, sin, interleaved)
    plain_rope = x.detach() * cos + rotate_half(x.detach(), interleaved) * sin
    assert torch.equal(got, plain_rope)
    if dtype == torch.float32:
        assert torch.equal(got, _apply_rotary_pos_emb_bshd(x.detach(), tables.angles, interleaved))
    grad = torch.randn_like(got)
    (mine,) = torch.autograd.grad(got, x, grad)
    plain = x.detach().float().requires_grad_()
    (expected,) = torch.autograd.grad(plain * cos + rotate_half(plain, interleaved) * sin, plain, grad)
    assert torch.equal(mine, expected.to(dtype))


@pytest.mark.parametrize("interleaved", [False, True])
def test_a_large_rotation_on_the_cpu_is_written_heads_major_with_the_same_values(interleaved):
    """Self-attention's RoPE without q / k norms (``LeanSelfAttention.rotated``): from
    ``WRITTEN_BY_CHANNEL_SET`` elements the rotated q / k come out heads-major ([b, np, s, d] memory,
    what SDPA's CPU flash kernel reads fastest), equal bit for bit to the rotation in megatron's layout,
    gradients too; the value's copy is heads-major as well."""
    heads, dim = 4, 16
    tokens = WRITTEN_BY_CHANNEL_SET // (heads * dim) + 3
    tables = RotaryTables(torch.rand(tokens, 1, 1, dim) * 6, interleaved)
    cos, sin = tables.cos_sin(torch.float32)
    fused_qkv = torch.randn(tokens, 1, heads, 3 * dim)
    x = fused_qkv[..., :dim].requires_grad_()
    got = LeanSelfAttention.rotated(SimpleNamespace(rotary=tables), x, cos, sin)
    expected = apply_rotary(x, cos, sin, interleaved)
    assert torch.equal(got, expected)
    assert heads_major(got).is_contiguous()
    grad = torch.randn_like(expected)
    assert torch.equal(*(torch.autograd.grad(out, x, grad)[0] for out in (got, expected)))
    value = heads_major_copy(fused_qkv[..., 2 * dim :])
    assert torch.equal(value, fused_qkv[..., 2 * dim :]) and heads_major(value).is_contiguous()


SEGMENTS = {
    "padding": [(0, 3, 0, 2), (4, 2, 2, 3), (6, 3, 5, 1)],  # row 3 and the last row: padding
    # context parallel: a rank's two query chunks of one sample read the same keys
    "shared_keys": [(0, 3, 0, 5), (4, 2, 0, 5), (6, 3, 5, 2)],
}


@pytest.mark.parametrize("segments", list(SEGMENTS.values()), ids=list(SEGMENTS))
def test_cpu_segment_attention_equals_sdpa_per_segment(segments):

    def reference(query, key, value, segments, scale):
        out = torch.zeros_like(query)
        for q0, nq, k0, nk in segments:
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query[q0 : q0 + nq], key[k0 : k0 + nk], value[k0 : k0 + nk]))
            out[q0 : q0 + nq] = F.scaled_dot_product_attention(q, k, v, scale=scale).permute(2, 0, 1, 3)
        return out

    inputs = (rand(10, 1, 2, 4), rand(7, 1, 2, 4, seed=1), rand(7, 1, 2, 4, seed=2), segments, 0.4)
    assert_same_grads(segment_attention_cpu, reference, inputs)
