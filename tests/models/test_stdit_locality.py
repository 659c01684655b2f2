"""ST-DiT locality by autograd: d out_i / d in_j is zero wherever attention must not mix.

Spatial attention mixes only tokens of the same frame of the same sample, temporal only tokens at
the same (h, w) of the same sample; padding mixes with nothing. The dependency pattern is read
from the Jacobian of each branch (and of a whole block) of a randomly initialised layer.
"""

import pytest
import torch

from dfm.models.common.embeddings import rope_3d_freqs
from tests.models._helpers import build_random_model, conditioning, make_samples, pack_samples, tiny_config


@pytest.fixture(scope="module")
def setup(dist):
    cfg = tiny_config("stdit", hidden_size=16, num_attention_heads=2, num_layers=1)
    model = build_random_model(cfg).double()
    pack = pack_samples(make_samples(cfg)[:3], segment_multiple=8)
    pack.context = pack.context.double()
    c_noise, _ = conditioning(pack.num_samples)
    hidden = torch.randn(pack.seq_len, 1, cfg.hidden_size, dtype=torch.double)
    return model, pack, c_noise.double(), hidden


def dependency(fn, hidden) -> torch.Tensor:
    """[S, S] bool: output token i depends on input token j. One backward per output token, of a random
    combination of its features (not one per feature, as the full Jacobian takes): structural zeros stay
    exactly zero, and a real dependency cancels only with probability zero."""
    x = hidden.detach().requires_grad_(True)
    out = fn(x)  # [S, 1, h]
    weights = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(0))
    rows = []
    for i in range(out.shape[0]):
        (grad,) = torch.autograd.grad(out[i], x, weights[i], retain_graph=True)
        rows.append(grad.abs().sum(dim=(1, 2)) > 0)
    return torch.stack(rows)


def expected(pack, same_group) -> torch.Tensor:
    """Real tokens of one sample that share the group mix; everything depends on itself."""
    sample = pack.token_sample_ids()
    real = pack.loss_mask.bool()
    allowed = (sample[:, None] == sample[None]) & real[:, None] & real[None] & same_group
    return allowed | torch.eye(pack.seq_len, dtype=torch.bool)


def branches(model, pack, c_noise):
    layer = model.layers[0]
    layout = model.self_attention_params(pack)
    mods = layer.adaln(model.conditioning(c_noise, None), pack.token_sample_ids())
    rope = rope_3d_freqs(pack.pos_ids, model.config.kv_channels).double()

    def spatial(x):
        return layer.attend(layer.self_attention, layer.norm1, x, mods[0:3], rope, layout.spatial)

    def temporal(x):
        return layer.attend(layer.temporal_attention, layer.norm_temporal, x, mods[3:6], rope, layout.temporal)

    return spatial, temporal


@pytest.mark.slow
def test_spatial_attention_mixes_only_within_a_frame(setup):
    model, pack, c_noise, hidden = setup
    spatial, _ = branches(model, pack, c_noise)
    t = pack.pos_ids[:, 0]
    assert torch.equal(dependency(spatial, hidden), expected(pack, t[:, None] == t[None]))


@pytest.mark.slow
def test_temporal_attention_mixes_only_at_one_position(setup):
    model, pack, c_noise, hidden = setup
    _, temporal = branches(model, pack, c_noise)
    hw = pack.pos_ids[:, 1:]
    assert torch.equal(dependency(temporal, hidden), expected(pack, (hw[:, None] == hw[None]).all(-1)))


@pytest.mark.slow
def test_a_block_mixes_only_within_a_sample(setup):
    model, pack, c_noise, hidden = setup
    layer = model.layers[0]
    inputs = model.pack_inputs(pack, model.layout.pack_split(pack), model.conditioning(c_noise, None))
    inputs.rotary_pos_emb = None

    def block(x):
        return layer(x, inputs)

    everything = torch.ones(pack.seq_len, pack.seq_len, dtype=torch.bool)
    assert torch.equal(dependency(block, hidden), expected(pack, everything))
