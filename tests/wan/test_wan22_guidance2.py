"""Wan 2.2 A14B's second guidance scale: the low-noise expert's steps guided by guidance_scale_2,
as WanPipeline(transformer, transformer_2, boundary_ratio)(guidance_scale, guidance_scale_2) does."""

import dataclasses

import pytest

from dfm.convert.wan import parity_samples
from dfm.data.packing import pack_samples
from dfm.data.patchify import unpatchify
from dfm.diffusion.pipeline import SamplingOptions
from dfm.diffusion.registry import build_pipeline
from dfm.diffusion.timestep_experts import TimestepExperts
from dfm.inference.sampling import sample_latent
from tests.wan._tiny import dfm_wan_of, tiny_model_config
from tests.wan.test_wan22_experts import BOUNDARY, experts
from tests.wan.test_wan_sampling import GUIDANCE, SHIFT, STEPS, TOLERANCE, pipeline_latents, wan_pipeline

GUIDANCE_2 = 2.0  # the low-noise expert's (GUIDANCE: the high-noise one's)


@pytest.mark.filterwarnings("ignore")
def test_second_guidance_scale_matches_wan_pipeline(dist):
    cfg = tiny_model_config()
    net = TimestepExperts(*(dfm_wan_of(t, cfg) for t in experts()), boundary=1000.0 * BOUNDARY)
    start, negative = parity_samples(cfg, shapes=[((3, 4, 6), 5), ((3, 4, 6), 3)])
    noise = unpatchify(start.tokens, start.latent_shape, cfg.patch_temporal, cfg.patch_spatial)
    pack, uncond = pack_samples([start]), pack_samples([dataclasses.replace(start, text=negative.text)])
    flow = build_pipeline("flow", c_noise_scale=1000.0, shift=SHIFT)
    options = SamplingOptions(STEPS, GUIDANCE, "euler", guidance_scale_2=GUIDANCE_2, guidance_boundary=BOUNDARY)
    ours = sample_latent(net, flow, pack, cfg, options, uncond=uncond)
    high, low = experts()
    pipe = wan_pipeline(high, transformer_2=low, boundary_ratio=BOUNDARY)
    theirs = pipeline_latents(pipe, start, negative, noise, guidance_scale_2=GUIDANCE_2)
    error = (ours - theirs).abs().max().item()
    print(f"guidance_scale_2 parity: {error:.2e}")
    assert error <= TOLERANCE, error
    # The second scale acted: one scale for all steps gives other latents.
    one_scale = sample_latent(net, flow, pack, cfg, SamplingOptions(STEPS, GUIDANCE, "euler"), uncond=uncond)
    assert (one_scale - theirs).abs().max().item() > 100 * TOLERANCE


def test_guidance_at_switches_at_the_boundary():
    """(--guidance_scale_2 without two experts is refused once the checkpoint is read: a both-run's
    checkpoint is one; test_wan22_both_experts.py.)"""
    options = SamplingOptions(4, 5.0, guidance_scale_2=2.0, guidance_boundary=0.9)
    assert [options.guidance_at(t) for t in (1.0, 0.9, 0.8999, 0.0)] == [5.0, 5.0, 2.0, 2.0]
    assert SamplingOptions(4, 5.0).guidance_at(0.0) == 5.0 and SamplingOptions(4, 1.0, guidance_scale_2=3.0).guided
