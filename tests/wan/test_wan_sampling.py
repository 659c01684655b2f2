"""Generation: dfm's sampling (dfm.inference.sampling, what inference_dit_model.py runs: Euler, shift,
classifier-free guidance with a negative prompt) on the converted weights gives the latents of
diffusers' WanPipeline on the same noise and text embeddings.

WanPipeline's scheduler is given dfm's schedule (its own ends at sigma = shift(1/1000), not 0); the
rest, the timestep 1000 t, guidance and Euler steps, is diffusers' own loop.
"""

import dataclasses

import diffusers
import pytest
import torch

from dfm.convert.rules import to_dfm
from dfm.convert.wan import parity_samples, rules
from dfm.convert.weights import fill_weights
from dfm.data.packing import pack_samples
from dfm.data.patchify import unpatchify
from dfm.diffusion.pipeline import SamplingOptions
from dfm.diffusion.registry import build_pipeline
from dfm.inference.sampling import sample_latent
from dfm.models.build import build_model
from tests.wan._tiny import TEXT_LEN, tiny_diffusers_wan, tiny_model_config

STEPS, SHIFT, GUIDANCE = 4, 5.0, 5.0
TOLERANCE = 1e-4  # fp32, 4 steps x 2 model calls (measured 3e-6 on latents of size ~5)


def padded(text: torch.Tensor) -> torch.Tensor:
    """[L, D] -> [1, TEXT_LEN, D] zero-padded, as WanPipeline pads UMT5 features."""
    out = torch.zeros(1, TEXT_LEN, text.shape[-1])
    out[0, : text.shape[0]] = text
    return out


def wan_pipeline(transformer, shift: float = SHIFT, pipeline=diffusers.WanPipeline, **components):
    """``pipeline`` (WanPipeline or WanImageToVideoPipeline) around ``transformer`` on dfm's schedule;
    ``components``: the rest (transformer_2, boundary_ratio, vae, ...)."""
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=shift)
    set_timesteps = scheduler.set_timesteps
    # dfm's schedule, before the shift that the scheduler applies itself: 1, (n-1)/n, ..., 1/n, then 0.
    scheduler.set_timesteps = lambda num_inference_steps, device=None, **kw: set_timesteps(
        sigmas=[1 - i / num_inference_steps for i in range(num_inference_steps)], device=device
    )
    parts = {"tokenizer": None, "text_encoder": None, "vae": None, **components}
    return pipeline(scheduler=scheduler, transformer=transformer, **parts)


def pipeline_latents(pipe, start, negative, noise, spatial: int = 16, **inputs) -> torch.Tensor:
    """``pipe``'s latents [C, T, H, W] from ``noise`` for ``start``'s text (``negative``'s: the negative
    prompt), STEPS steps at guidance GUIDANCE; ``spatial``: the VAE's pixels per latent (the size asked
    for); ``inputs``: more (e.g. the image)."""
    _, t, h, w = start.latent_shape
    with torch.no_grad():
        return pipe(
            prompt_embeds=padded(start.text),
            negative_prompt_embeds=padded(negative.text),
            latents=noise[None],
            height=spatial * h,
            width=spatial * w,
            num_frames=4 * (t - 1) + 1,
            num_inference_steps=STEPS,
            guidance_scale=GUIDANCE,
            output_type="latent",
            **inputs,
        ).frames[0]


@pytest.mark.filterwarnings("ignore")
def test_dfm_sampler_matches_wan_pipeline(dist):
    transformer = tiny_diffusers_wan()
    cfg = tiny_model_config()
    model, _ = build_model(cfg, "fp32")
    fill_weights(model, to_dfm(transformer.state_dict(), rules(cfg)), "the tiny diffusers Wan")
    model.eval()
    # The first sample's latent is the starting noise; the second one's text is the negative prompt.
    start, negative = parity_samples(cfg, shapes=[((3, 4, 6), 5), ((3, 4, 6), 3)])
    noise = unpatchify(start.tokens, start.latent_shape, cfg.patch_temporal, cfg.patch_spatial)
    pack = pack_samples([start])
    uncond = pack_samples([dataclasses.replace(start, text=negative.text)])
    flow = build_pipeline("flow", c_noise_scale=1000.0, shift=SHIFT)
    ours = sample_latent(model, flow, pack, cfg, SamplingOptions(STEPS, GUIDANCE, "euler"), uncond=uncond)
    theirs = pipeline_latents(wan_pipeline(transformer), start, negative, noise)
    assert (ours - theirs).abs().max().item() <= TOLERANCE
