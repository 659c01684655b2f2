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
