"""adaLN-Zero: a freshly built block is the identity on its input; the final layer starts at zero."""

import pytest
import torch

from dfm.models.build import build_model_chunk
from dfm.models.dit.dit_model import packed_seq_params
from dfm.models.common.embeddings import rope_3d_freqs
from tests.models._helpers import ARCHITECTURES, conditioning, make_samples, pack_samples, tiny_config


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_fresh_blocks_are_identity_and_final_layer_is_zero(dist, name):
    cfg = tiny_config(name)
    model, _ = build_model_chunk(cfg, "fp32", seed=3)
    pack = pack_samples(make_samples(cfg), segment_multiple=8)
    c_noise, labels = conditioning(pack.num_samples)
    cond = model.conditioning(c_noise, labels)
    context = model.text_embedder(pack.context).unsqueeze(1) if model.cross else None
    cross_params = packed_seq_params(pack, cross=True) if model.cross else None
    rope = rope_3d_freqs(pack.pos_ids, cfg.hidden_size // cfg.num_attention_heads)
    hidden = torch.randn(pack.seq_len, 1, cfg.hidden_size)
    for layer in model.layers:
        out = layer(hidden, cond, pack.token_sample_ids(), context, rope, model.self_attention_params(pack), cross_params)
        assert torch.equal(out, hidden)

    final = model.final_layer
    assert torch.count_nonzero(final.linear.weight) == 0 and torch.count_nonzero(final.adaln.weight) == 0
    assert torch.count_nonzero(model(pack.latents, c_noise, pack, labels)) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_to_tokens_matches_a_gather_forward_and_backward(dtype):
    """The segment-sum backward equals a gather's, including samples with no tokens (a CP chunk)."""
    from dfm.models.common.adaln import rows_to_tokens

    ids = torch.tensor([0, 0, 0, 2, 2, 3, 3, 3, 3, 5])  # rows 1 and 4 own no token
    rows = torch.randn(6, 7, dtype=dtype, requires_grad=True)
    grad = torch.randn(len(ids), 7, dtype=dtype)
    out = rows_to_tokens(rows, ids)
    (expected_grad,) = torch.autograd.grad(rows[ids], rows, grad)
    (got_grad,) = torch.autograd.grad(out, rows, grad)
    assert torch.equal(out, rows[ids])
    assert got_grad.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got_grad, expected_grad, rtol=1e-6, atol=1e-6)
    else:  # bf16: summed in fp32, so at least as close to the exact sum as the gather's bf16 adds
        (exact,) = torch.autograd.grad(rows.double()[ids], rows, grad.double())
        assert (got_grad.double() - exact).abs().max() <= (expected_grad.double() - exact).abs().max()
    assert torch.count_nonzero(got_grad[[1, 4]]) == 0
