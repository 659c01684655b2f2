"""Wan 2.2 TI2V's per-token timesteps: a mixed pack of TI2V samples (first frame clean, at timestep
0) and text-to-video ones (one timestep each) equals diffusers' WanTransformer3DModel given each
sample alone with its timestep per token (``expand_timesteps``), fp32, outputs <= 1e-5 and
gradients; the training step feeds the first frames clean and leaves them out of the loss."""

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
from dfm.diffusion.first_frame import first_frame_tokens, keep_first_frames_clean
from dfm.diffusion.pipeline import build_pipeline
from dfm.models.build import build_model
from dfm.training.forward_step import DiffusionForwardStep
from tests.wan._tiny import TEXT_LEN, TINY_TI2V, tiny_diffusers_wan, tiny_model_config

FORWARD_TOLERANCE = 1e-5
GRAD_TOLERANCE = 1e-4  # relative to each gradient's max, as tests/wan/test_wan_parity.py
MIXED = (True, False, True)  # samples 0 and 2 (3 and 2 frames) are TI2V, sample 1 text-to-video


@pytest.fixture(scope="module")
def models(dist):
    transformer = tiny_diffusers_wan(config=TINY_TI2V)
    cfg = tiny_model_config(TINY_TI2V)
    model, _ = build_model(cfg, "fp32")
    fill_weights(model, to_dfm(transformer.state_dict(), rules(cfg)), "the tiny diffusers TI2V Wan")
    return transformer, model, cfg


@pytest.fixture(scope="module")
def pack(models):
    samples = parity_samples(models[2], first_frame_clean=MIXED)
    return samples, pack_samples(samples, segment_multiple=4), parity_timesteps(len(samples))


def test_mixed_pack_matches_diffusers_with_per_token_timesteps(models, pack):
    transformer, model, cfg = models
    samples, batch, timesteps = pack
    transformer.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    gen = torch.Generator().manual_seed(7)
    upstream = [torch.randn(s.latent_shape, generator=gen) for s in samples]
    references = [diffusers_sample_output(transformer, s, t, TEXT_LEN) for s, t in zip(samples, timesteps)]
    sum((r * g).sum() for r, g in zip(references, upstream)).backward()
    outputs = dfm_sample_outputs(model(batch.latents, timesteps, batch), batch, cfg)
    sum((o * g).sum() for o, g in zip(outputs, upstream)).backward()
    assert max_abs_diff([o.detach() for o in outputs], [r.detach() for r in references]) <= FORWARD_TOLERANCE
    dfm_grads = to_diffusers({name: p.grad for name, p in model.named_parameters()}, rules(cfg))
    for name, param in transformer.named_parameters():
        error = (dfm_grads[name] - param.grad).abs().max().item()
        assert error <= GRAD_TOLERANCE * param.grad.abs().max().item(), (name, error)


def test_per_token_timesteps_matter(models, pack):
    """The same pack without the flags differs (the first frames' timestep is not ignored)."""
    _, model, _ = models
    _, batch, timesteps = pack
    flat = pack_samples(parity_samples(models[2]), segment_multiple=4)
    with torch.no_grad():
        assert (model(batch.latents, timesteps, batch) - model(flat.latents, timesteps, flat)).abs().max() > 1e-3


def test_training_step_feeds_first_frames_clean_and_leaves_them_out_of_the_loss(models, pack):
    _, model, cfg = models
    samples, batch, _ = pack
    clean = first_frame_tokens(batch)
    grid = [s.latent_shape[2] * s.latent_shape[3] // 4 for s in samples]  # tokens per frame
    assert int(clean.sum()) == grid[0] + grid[2]
    x_in, loss_batch = keep_first_frames_clean(torch.randn_like(batch.latents), batch)
    assert torch.equal(x_in[clean], batch.latents[clean])
    assert torch.equal(loss_batch.loss_mask, batch.loss_mask * ~clean)
    step = DiffusionForwardStep(
        build_pipeline("flow", c_noise_scale=1000.0), seed=0, cfg_dropout_prob=0.0, device=torch.device("cpu")
    )
    prepared = step.prepare(batch)
    with torch.no_grad():
        output, loss_fn = step.run(model, *prepared)
        loss, _ = loss_fn(output)
        changed = output.clone()
        changed[clean] += 100.0  # what the model says on condition tokens does not count
        assert torch.equal(loss_fn(changed)[0], loss)
    assert torch.isfinite(loss)
