"""Generation: dfm's flow sampler on the FLUX model follows FluxPipeline's denoising loop (diffusers'
FlowMatchEulerDiscreteScheduler with FLUX's resolution-dependent shift, the guidance embedding, the
transformer called with t = sigma) step for step: same final latents from the same noise."""

from __future__ import annotations

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

from dfm.convert.flux import diffusers_inputs, reorder_patch_features, verification_pack
from dfm.convert.pretrained import converted_model
from dfm.diffusion.flow import FlowPipeline, FlowSettings, shift_for_num_tokens
from tests.flux._tiny import dfm_config_and_weights, tiny_diffusers_flux

# FLUX.1-dev's scheduler_config.json.
FLUX_SCHEDULER = dict(
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
)
STEPS, GUIDANCE = 4, 3.5


def fluxpipeline_loop(transformer, inputs: dict, latents: torch.Tensor) -> torch.Tensor:
    """FluxPipeline.__call__'s timesteps and denoising loop for one sample (latents [1, L, D])."""
    scheduler = FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER)
    mu = calculate_shift(latents.shape[1])
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / STEPS, STEPS), mu=mu)
    for t in scheduler.timesteps:
        noise_pred = transformer(**{**inputs, "hidden_states": latents, "timestep": t.expand(1) / 1000}).sample
        latents = scheduler.step(noise_pred, t, latents).prev_sample
    return latents


def test_flow_sampler_follows_fluxpipeline_loop():
    reference = tiny_diffusers_flux()
    cfg, weights = dfm_config_and_weights(reference)
    batch, _, _ = verification_pack(cfg.model)
    channels, guidance = cfg.model.in_channels, torch.full((batch.num_samples,), GUIDANCE)
    noise = torch.randn(batch.latents.shape, generator=torch.Generator().manual_seed(5)) * batch.loss_mask[:, None]
    starts, lengths = batch.host_view().cu_seqlens_q_padded.tolist(), batch.host_sample_lengths()
    with converted_model(cfg.model, weights, cfg.rng.seed) as model:
        for i, (start, length) in enumerate(zip(starts, lengths)):
            # One shift per sampling call: FLUX's for this sample's token count (the pack's others are ignored).
            pipeline = FlowPipeline(FlowSettings(shift=shift_for_num_tokens(length)))
            x0 = pipeline.sample(
                lambda x, t, batch: model(x, t, batch, guidance),
                noise,
                batch.token_sample_ids(),
                STEPS,
                cond={"batch": batch},
            )
            inputs = diffusers_inputs(batch, batch.latents, torch.zeros(batch.num_samples), guidance, i, channels)
            sample_noise = reorder_patch_features(noise[start : start + length], 1, "pqc", "cpq", channels)
            expected = fluxpipeline_loop(reference, inputs, sample_noise[None])[0]
            got = reorder_patch_features(x0[start : start + length], 1, "pqc", "cpq", channels)
            assert float((got - expected).abs().max()) <= 1e-5, i
