"""adaLN-Zero: a freshly built block is the identity on its input; the final layer starts at zero."""

import pytest
import torch

from dfm.models.build import build_model_chunk
from dfm.models.common.embeddings import rope_3d_freqs
from tests.models._helpers import ARCHITECTURES, conditioning, make_samples, pack_samples, tiny_config


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_fresh_blocks_are_identity_and_final_layer_is_zero(dist, name):
    cfg = tiny_config(name)
    model, _ = build_model_chunk(cfg, "fp32", seed=3)
    pack = pack_samples(make_samples(cfg), segment_multiple=8)
    c_noise, labels = conditioning(pack.num_samples)
    cond = model.conditioning(c_noise, labels)
    inputs = model.pack_inputs(pack, model.layout.pack_split(pack), cond)
    inputs.rotary_pos_emb = rope_3d_freqs(pack.pos_ids, cfg.hidden_size // cfg.num_attention_heads)
    hidden = torch.randn(pack.seq_len, 1, cfg.hidden_size)
    for layer in model.layers:
        out = layer(hidden, inputs)
        assert torch.equal(out, hidden)

    final = model.final_layer
    assert torch.count_nonzero(final.linear.weight) == 0 and torch.count_nonzero(final.adaln.weight) == 0
    assert torch.count_nonzero(model(pack.latents, c_noise, pack, labels)) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_to_tokens_matches_a_gather_forward_and_backward(dtype):
    """The backward equals a gather's, including rows no token takes (a CP chunk); both ways of
    summing (CUDA's one-hot GEMM, the CPU's index_add_) are checked here on the CPU."""
    from dfm.models.common.adaln import rows_to_tokens, sum_rows_by_index_add, sum_rows_by_one_hot_gemm

    ids = torch.tensor([0, 0, 0, 2, 2, 3, 3, 3, 3, 5])  # rows 1 and 4 own no token
    rows = torch.randn(6, 7, dtype=dtype, requires_grad=True)
    grad = torch.randn(len(ids), 7, dtype=dtype)
    out = rows_to_tokens(rows, ids)
    (expected,) = torch.autograd.grad(rows.double()[ids], rows, grad.double())  # exact sums, rounded once
    (got,) = torch.autograd.grad(out, rows, grad)
    assert torch.equal(out, rows[ids])
    for summed in (got, sum_rows_by_index_add(grad, ids, 6), sum_rows_by_one_hot_gemm(grad, ids, 6)):
        assert summed.dtype == dtype
        torch.testing.assert_close(summed, expected, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-6)
        assert torch.count_nonzero(summed[[1, 4]]) == 0
