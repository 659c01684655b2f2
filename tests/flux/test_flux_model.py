"""FLUX.1 against diffusers' FluxTransformer2DModel (the oracle), on a tiny random model the tests build.

* forward: one pack of three images of different sizes and text lengths; each sample must match
  diffusers run on that sample alone to 1e-5 (fp32), in one process and at TP=2 + SP, CP=2, PP=2
  (one 2-process launch that re-initialises megatron's parallel state per layout);
* one backward: every parameter's gradient, mapped to diffusers' names by the same rules;
* the rules: diffusers -> dfm -> diffusers is bit exact, with and without the guidance embedder.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dfm.convert.flux import (
    diffusers_inputs,
    diffusers_outputs,
    flux_rules,
    reorder_patch_features,
    verification_pack,
)
from dfm.convert.rules import to_dfm, to_diffusers
from dfm.convert.weights import single_process_world
from dfm.diffusion.registry import build_pipeline
from dfm.models.presets_cli import preset_parameter_counts
from dfm.training.forward_step import DiffusionForwardStep
from tests._layouts import LAYOUTS, assert_outputs_match, layout_results
from tests._parity import (
    assert_bit_equal,
    assert_grads_match,
    assert_mixed_pack,
    assert_pack_matches,
    converted_model,
    dfm_pack_grads,
    dfm_pack_output,
)
from tests.flux._tiny import dfm_config_and_weights, tiny_diffusers_flux
from tests.models.test_no_host_sync import DeviceTensor, on_fake_device

WORKER = Path(__file__).with_name("_layouts_worker.py")
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def tiny():
    reference = tiny_diffusers_flux()
    cfg, weights = dfm_config_and_weights(reference)
    return reference, cfg, weights


def test_forward_matches_diffusers_per_sample_in_a_mixed_pack(tiny):
    reference, cfg, weights = tiny
    batch, t, guidance = verification_pack(cfg.model)
    assert_mixed_pack(batch)
    packed = dfm_pack_output(cfg, weights, (batch.latents, t, batch, guidance))
    references = diffusers_outputs(reference, batch, t, guidance, cfg.model.in_channels)
    assert_pack_matches(packed, references, batch, TOLERANCE)


def test_one_backward_gives_diffusers_gradients(tiny):
    reference, cfg, weights = tiny
    channels = cfg.model.in_channels
    batch, t, guidance = verification_pack(cfg.model)
    upstream = torch.randn(batch.latents.shape, generator=torch.Generator().manual_seed(3)) * batch.loss_mask[:, None]
    grads = dfm_pack_grads(cfg, weights, (batch.latents, t, batch, guidance), upstream)
    reference.zero_grad()
    starts = batch.host_view().cu_seqlens_q_padded.tolist()
    for i, start in enumerate(starts[:-1]):
        out = reference(**diffusers_inputs(batch, batch.latents, t, guidance, i, channels)).sample[0]
        (
            out * reorder_patch_features(upstream[start : start + out.shape[0]], 1, "pqc", "cpq", channels)
        ).sum().backward()
    assert_grads_match(reference, grads, flux_rules(cfg.model), TOLERANCE)


@pytest.mark.parametrize("guidance_embeds", [True, False], ids=["dev", "schnell"])
def test_rules_round_trip_bit_exact(guidance_embeds):
    reference = tiny_diffusers_flux(guidance_embeds=guidance_embeds)
    cfg, weights = dfm_config_and_weights(reference)
    assert cfg.model.guidance_embeds is guidance_embeds
    back = to_diffusers(to_dfm(reference.state_dict(), flux_rules(cfg.model)), flux_rules(cfg.model))
    assert_bit_equal(back, reference.state_dict())


@pytest.mark.slow
def test_tp2_sp_cp2_pp2_forward_match_diffusers(tiny, tmp_path):
    reference, cfg, weights = tiny
    batch, t, guidance = verification_pack(cfg.model)
    references = diffusers_outputs(reference, batch, t, guidance, cfg.model.in_channels)
    case = tmp_path / "case.pt"
    torch.save({"config": dict(reference.config), "weights": weights, "references": references}, case)
    results = layout_results(WORKER, tmp_path, args=(case,))
    for layout in LAYOUTS:
        assert_outputs_match(results, layout, TOLERANCE)
    assert results[0]["pp2"] is None, results  # the first PP stage holds no output


def test_flux1_presets_have_the_diffusers_parameter_counts():
    # diffusers FluxTransformer2DModel(guidance_embeds=True / False) on the meta device.
    counts = preset_parameter_counts(["FLUX.1-dev", "FLUX.1-schnell"])
    assert counts == {"FLUX.1-dev": 11_901_408_320, "FLUX.1-schnell": 11_891_178_560}


def test_micro_batch_device_work_never_reads_back(tiny):
    """As tests/models/test_no_host_sync.py for the DiT family: the joint-attention plan is host work."""
    _, cfg, weights = tiny
    batch, _, _ = verification_pack(cfg.model, padding=(4, 4))
    step = DiffusionForwardStep(build_pipeline("flow"), seed=1, cfg_dropout_prob=0.5, device=torch.device("cpu"))
    with single_process_world(cfg.rng.seed):
        model = converted_model(cfg, weights)
        batch, noise, level = step.prepare(batch)
        noise, level = noise.as_subclass(DeviceTensor), level.as_subclass(DeviceTensor)
        DeviceTensor.reads = []
        output, loss_fn = step.run(model, on_fake_device(batch), noise, level)
        loss_fn(output)[0].backward()
    assert DeviceTensor.reads == [], "\n".join(DeviceTensor.reads)
    assert all(p.grad is not None for p in model.parameters())
