"""Packs of one sample length: the row ops and the final layer broadcast the rows over [N, L, b, h] (``per_row``) instead of
gathering them per token; packs grouped by length, one broadcast per run of one length (``per_row`` a tuple of
(rows, L) runs). Forward bitwise and backward (float64) equal to the gathered path, and the model takes
that path exactly when its rank holds whole samples in order."""

import pytest
import torch
import torch.nn.functional as F

from dfm.models.common.norm_recompute import norm_modulate_rows
from dfm.models.common.row_modulation import MIN_RUN_ELEMENTS, gated_residual_rows, row_layout

N, L, B, H = 3, 5, 2, 6
IDS = torch.arange(N).repeat_interleave(L)
RUNS = ((1, 4), (2, 2), (1, 3))  # 4 rows of 4, 2, 2 and 3 tokens: 11 tokens, 4 rows
RUN_IDS = torch.tensor([0] * 4 + [1] * 2 + [2] * 2 + [3] * 3)


def rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def grads(fn, inputs):
    out = fn(*inputs)
    tensors = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    return out, torch.autograd.grad(out, tensors, torch.ones_like(out) + out.detach())


def assert_paths_agree(fn, inputs_of, per_row=L):
    gathered, broadcast = grads(fn, inputs_of(0)), grads(fn, inputs_of(per_row))
    torch.testing.assert_close(broadcast[0], gathered[0], rtol=0, atol=0)
    for got, expected in zip(broadcast[1], gathered[1]):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(fn, inputs_of(per_row))


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_norm_modulate_runs_equal_gathered(rms):
    x, shift, scale = rand(11, B, H), rand(4, H, seed=1), rand(4, H, seed=2)
    assert_paths_agree(norm_modulate_rows, lambda per_row: (x, shift, scale, RUN_IDS, 1e-6, rms, per_row), RUNS)


@pytest.mark.parametrize("with_bias", [False, True])
def test_gated_residual_runs_equal_gathered(with_bias):
    x, gate, out = rand(11, B, H), rand(4, H, seed=1), rand(11, B, H, seed=2)
    bias = rand(H, seed=3) if with_bias else None
    assert_paths_agree(gated_residual_rows, lambda per_row: (x, gate, RUN_IDS, out, bias, per_row), RUNS)


def test_bf16_tokens_with_fp32_rows_modulate_in_fp32():
    x = rand(11, B, H, dtype=torch.float32).detach().bfloat16()
    shift, scale = rand(4, H, seed=1, dtype=torch.float32).detach(), rand(4, H, seed=2, dtype=torch.float32).detach()
    expected = F.layer_norm(x, (H,), eps=1e-6) * (1 + scale[RUN_IDS, None]) + shift[RUN_IDS, None]
    for per_row in (0, RUNS):
        got = norm_modulate_rows(x, shift, scale, RUN_IDS, 1e-6, False, per_row)
        assert got.dtype == torch.float32
        assert torch.equal(got, expected)


def test_row_layout_of_lengths():
    wide = MIN_RUN_ELEMENTS  # every run broadcast
    assert row_layout([4, 4, 4], 12, 1) == 4  # one run: always
    assert row_layout([4, 2, 2, 3], 11, wide) == RUNS
    assert row_layout([4, 4, 4], 13, wide) == 0  # tokens no sample holds
    assert row_layout([4, 2, 2, 3], 11, 64) == 0  # small runs: gathered, cheaper than a call per run


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_norm_modulate_broadcast_equals_gathered(rms):
    x, shift, scale = rand(N * L, B, H), rand(N, H, seed=1), rand(N, H, seed=2)
    assert_paths_agree(norm_modulate_rows, lambda per_row: (x, shift, scale, IDS, 1e-6, rms, per_row))


@pytest.mark.parametrize("with_bias", [False, True])
def test_gated_residual_broadcast_equals_gathered(with_bias):
    x, gate, out = rand(N * L, B, H), rand(N, H, seed=1), rand(N * L, B, H, seed=2)
    bias = rand(H, seed=3) if with_bias else None
    assert_paths_agree(gated_residual_rows, lambda per_row: (x, gate, IDS, out, bias, per_row))


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_final_layer_broadcast_equals_gathered(rms):
    from dfm.models.common.adaln import AdaLNNorm, AdaLNRMSNorm
    from dfm.models.common.final_layer import FinalLayer

    torch.manual_seed(0)
    layer = FinalLayer(H, 4, 1e-6, AdaLNRMSNorm if rms else AdaLNNorm).double()
    for p in layer.parameters():  # zero-initialised as in DiT: give the modulation and output something to do
        torch.nn.init.normal_(p)
    x, cond = rand(N * L, B, H), rand(N, H, seed=1)
    assert_paths_agree(lambda x, cond, per_row: layer(x, cond, IDS, per_row), lambda per_row: (x, cond, per_row))


def test_fp32_forward_is_bitwise_the_gathered_one():
    x, shift, scale, gate = (rand(N * L, 1, H, seed=i, dtype=torch.float32).detach() for i in range(4))
    shift, scale, gate = shift[:N, 0], scale[:N, 0], gate[:N, 0]
    for per_row in (0, L):
        assert torch.equal(
            norm_modulate_rows(x, shift, scale, IDS, 1e-6, False, per_row),
            norm_modulate_rows(x, shift, scale, IDS, 1e-6, False, 0),
        )
        assert torch.equal(
            gated_residual_rows(x, gate, IDS, x, None, per_row), gated_residual_rows(x, gate, IDS, x, None)
        )
    from dfm.models.common.final_layer import FinalLayer

    layer = FinalLayer(H, 4, 1e-6)
    for p in layer.parameters():
        torch.nn.init.normal_(p)
    with torch.no_grad():
        assert torch.equal(layer(x, shift + gate, IDS, L), layer(x, shift + gate, IDS))


@pytest.mark.parametrize(
    ("video_sizes", "expected"),
    [([(4, 16, 16)], 256), ([(4, 16, 16), (2, 16, 16)], "runs")],
    ids=["one-shape", "mixed"],
)
def test_the_model_broadcasts_only_whole_samples_in_order(video_sizes, expected):
    from types import SimpleNamespace

    from dfm.data.mock import MockDataSettings, MockPackedLoader, MockPacking
    from dfm.models.dit.dit_model import DiTModel

    settings = MockDataSettings(video_sizes=video_sizes, image_fraction=0.0)
    pack = next(MockPackedLoader(settings, 0, 1, MockPacking(2048, samples_per_pack=4)))
    one_rank = SimpleNamespace(config=SimpleNamespace(sequence_parallel=False, hidden_size=256))
    if expected == "runs":  # grouped by length: each length's samples side by side
        lengths = pack.host_view().padded_sample_lengths.tolist()
        expected = tuple((lengths.count(n), n) for n in dict.fromkeys(lengths))
        assert len(expected) == 2 and sum(lengths) == pack.seq_len
    assert DiTModel.tokens_per_sample(one_rank, pack, SimpleNamespace(size=1)) == expected
    assert DiTModel.tokens_per_sample(one_rank, pack, SimpleNamespace(size=2)) == 0  # a CP rank's share
    sequence_parallel = SimpleNamespace(config=SimpleNamespace(sequence_parallel=True, hidden_size=256))
    assert DiTModel.tokens_per_sample(sequence_parallel, pack, SimpleNamespace(size=1)) == 0
