"""dfm's Wan equals diffusers' WanTransformer3DModel (the oracle), one process, fp32: a pack of
three samples of different (T, H, W) and text lengths against diffusers run on each sample alone
(its text zero-padded to model.max_text_len as WanPipeline pads it): outputs <= 1e-5 max abs
diff, and the parameter gradients of one backward (mapped to diffusers names by the rules)."""

import pytest
import torch

from dfm.convert.pretrained import fill_weights
from dfm.convert.rules import to_dfm, to_diffusers
from dfm.convert.wan import (
    dfm_sample_outputs,
    diffusers_sample_output,
    max_abs_diff,
    parity_samples,
    parity_timesteps,
    rules,
)
from dfm.data.packing import pack_samples
from dfm.models.build import build_model
from tests.wan._tiny import TEXT_LEN, tiny_diffusers_wan, tiny_model_config

FORWARD_TOLERANCE = 1e-5
GRAD_TOLERANCE = 1e-4  # relative to each gradient's max: fp32 sums in another order (measured <= 5.5e-5)


@pytest.fixture(scope="module")
def models(dist):
    transformer = tiny_diffusers_wan()
    cfg = tiny_model_config()
    model, _ = build_model(cfg, "fp32")
    fill_weights(model, to_dfm(transformer.state_dict(), rules(cfg)), "the tiny diffusers Wan")
    return transformer, model, cfg


@pytest.fixture(scope="module")
def pack(models):
    _, _, cfg = models
    samples = parity_samples(cfg)
    return samples, pack_samples(samples, segment_multiple=4), parity_timesteps(len(samples))


def test_forward_matches_diffusers_per_sample(models, pack):
    transformer, model, cfg = models
    samples, batch, timesteps = pack
    with torch.no_grad():
        references = [diffusers_sample_output(transformer, s, t, TEXT_LEN) for s, t in zip(samples, timesteps)]
        outputs = dfm_sample_outputs(model(batch.latents, timesteps, batch), batch, cfg)
    assert max_abs_diff(outputs, references) <= FORWARD_TOLERANCE


def test_gradients_match_diffusers(models, pack):
    """sum_i <out_i, g_i> backward: dfm's pack vs diffusers' per-sample runs summed."""
    transformer, model, cfg = models
    samples, batch, timesteps = pack
    gen = torch.Generator().manual_seed(7)
    upstream = [torch.randn((s.latent_shape), generator=gen) for s in samples]
    transformer.zero_grad(set_to_none=True)
    for sample, timestep, grad in zip(samples, timesteps, upstream):
        (diffusers_sample_output(transformer, sample, timestep, TEXT_LEN) * grad).sum().backward()
    model.zero_grad(set_to_none=True)
    outputs = dfm_sample_outputs(model(batch.latents, timesteps, batch), batch, cfg)
    sum((out * grad).sum() for out, grad in zip(outputs, upstream)).backward()
    dfm_grads = to_diffusers({name: p.grad for name, p in model.named_parameters()}, rules(cfg))
    for name, param in transformer.named_parameters():
        expected, actual = param.grad, dfm_grads[name]
        error = (actual - expected).abs().max().item()
        assert error <= GRAD_TOLERANCE * expected.abs().max().item(), (name, error)
