"""HunyuanVideo 1.5 against diffusers' HunyuanVideo15Transformer3DModel (the oracle), on a tiny random model.

* forward: one pack of four clips (text- and image-to-video mixed, different sizes, each with its
  own Qwen and ByT5 text lengths); each sample must match diffusers run on that sample alone to 1e-5 (fp32);
* one backward: every parameter's gradient, mapped to diffusers' names by the same rules;
* the rules: diffusers -> dfm -> diffusers is bit exact; the preset has diffusers' parameter count.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dfm.convert.hunyuan import diffusers_inputs, diffusers_outputs, hunyuan_rules, verification_pack
from dfm.convert.rules import to_dfm, to_diffusers
from dfm.data.patchify import patchify
from dfm.diffusion.flow import FlowPipeline, FlowSettings
from dfm.diffusion.registry import build_pipeline
from dfm.models.presets_cli import preset_parameter_counts
from dfm.training.forward_step import DiffusionForwardStep
from tests import _parity as parity
from tests.hunyuan._tiny import dfm_config_and_weights, tiny_diffusers_hunyuan

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def tiny():
    reference = tiny_diffusers_hunyuan()
    cfg, weights = dfm_config_and_weights(reference)
    return reference, cfg, weights


def test_forward_matches_diffusers_per_sample_in_a_mixed_pack(tiny):
    reference, cfg, weights = tiny
    batch, c_noise = verification_pack(cfg.model)
    parity.assert_mixed_pack(batch)
    image_to_video = batch.host_view().image_embeds.flatten(1).ne(0).any(1).tolist()
    assert True in image_to_video and False in image_to_video
    packed = parity.dfm_pack_output(cfg, weights, (batch.latents, c_noise, batch))
    parity.assert_pack_matches(packed, diffusers_outputs(reference, batch, c_noise), batch, TOLERANCE)


def test_one_backward_gives_diffusers_gradients(tiny):
    reference, cfg, weights = tiny
    batch, c_noise = verification_pack(cfg.model)
    upstream = torch.randn(batch.latents.shape, generator=torch.Generator().manual_seed(3)) * batch.loss_mask[:, None]
    grads = parity.dfm_pack_grads(cfg, weights, (batch.latents, c_noise, batch), upstream)
    reference.zero_grad()
    starts = batch.host_view().cu_seqlens_q_padded.tolist()
    for i, start in enumerate(starts[:-1]):
        out = patchify(reference(**diffusers_inputs(batch, batch.latents, c_noise, i)).sample[0], 1, 1)[0]
        (out * upstream[start : start + out.shape[0]]).sum().backward()
    # None: the last block's text-stream outputs (to_add_out, ff_context) reach no output.
    parity.assert_grads_match(reference, grads, hunyuan_rules(cfg.model), TOLERANCE)


def test_rules_round_trip_bit_exact(tiny):
    reference, cfg, _ = tiny
    state = reference.state_dict()
    back = to_diffusers(to_dfm(state, hunyuan_rules(cfg.model)), hunyuan_rules(cfg.model))
    parity.assert_bit_equal(back, state)


def test_presets_have_the_diffusers_parameter_count():
    # diffusers HunyuanVideo15Transformer3DModel() (the default config) on the meta device.
    counts = preset_parameter_counts(["HunyuanVideo-1.5-T2V-720p", "HunyuanVideo-1.5-I2V-720p"])
    assert counts == {"HunyuanVideo-1.5-T2V-720p": 8_326_608_160, "HunyuanVideo-1.5-I2V-720p": 8_326_608_160}


def test_training_step_picks_text_or_image_to_video_per_sample(tiny):
    """i2v_prob 0: every sample text-to-video (condition and image embedding zero); 1: the pack as is;
    0.5: a per-sample draw, the same for the same (seed, iteration, sample)."""
    _, cfg, _ = tiny
    batch, _ = verification_pack(cfg.model)
    batch = dataclasses.replace(batch, condition=batch.condition + 1.0, image_embeds=batch.image_embeds + 1.0)

    def prepared(i2v_prob: float, iteration: int = 0):
        step = DiffusionForwardStep(build_pipeline("flow"), 1, 0.0, torch.device("cpu"), i2v_prob)
        step.iteration = iteration
        return step.prepare(batch)[0]

    ids = batch.token_sample_ids()
    none, every, half = prepared(0.0), prepared(1.0), prepared(0.5)
    assert not none.condition.any() and not none.image_embeds.any()
    assert torch.equal(every.condition, batch.condition) and torch.equal(every.image_embeds, batch.image_embeds)
    image_to_video = half.image_embeds.flatten(1).any(1)
    for i, chosen in enumerate(image_to_video.tolist()):
        assert torch.equal(
            half.condition[ids == i], batch.condition[ids == i] if chosen else 0 * batch.condition[ids == i]
        )
    draws = torch.stack([prepared(0.5, it).image_embeds.flatten(1).any(1) for it in range(8)])
    assert torch.equal(draws[0], image_to_video) and 0 < draws.float().mean() < 1


def test_flow_uniform_mix_draws_some_uniform_times():
    flow = FlowPipeline(FlowSettings(logit_std=0.01, uniform_mix=0.25))  # logit-normal: all near 0.5
    t = flow.draw_t(4000, torch.Generator().manual_seed(0))
    assert abs(float(((t - 0.5).abs() > 0.05).float().mean()) - 0.25 * 0.9) < 0.03
