"""Generation: dfm's FLUX sampling (inference_dit_model.py's ``sample_prompt``: T5 at full length and
CLIP's pooled vector from the prompt, the embedded guidance, FLUX's resolution-dependent shift) gives
the latents diffusers' real ``FluxPipeline`` gives from the same weights, encoders and noise, and the
FLUX VAE decodes them (its shift and scaling factors) to the pipeline's image."""

from __future__ import annotations

import dataclasses
import shutil
from argparse import Namespace
from pathlib import Path

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

from dfm.convert.weights import converted_model
from dfm.data.encoders import build_tiny_random_encoders
from dfm.inference.encoders import EncoderSources, load_encoders
from dfm.inference.generate import sample_prompt, with_embedded_guidance
from dfm.inference.generation_batch import draw_noise, latent_shape_for
from tests.flux._tiny import TINY, dfm_config_and_weights, tiny_diffusers_flux

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
STEPS, GUIDANCE, TEXT_LEN, HEIGHT, WIDTH = 4, 3.5, 16, 64, 48
PROMPT = "a tiny red fox"


def tiny_flux_pipeline(reference, encoders) -> FluxPipeline:
    """The real pipeline assembled from the tiny transformer and the encoders dfm samples with."""
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER),
        vae=encoders.vae.model,
        text_encoder=encoders.pooled.model,
        tokenizer=encoders.pooled.tokenizer,
        text_encoder_2=encoders.text.model,
        tokenizer_2=encoders.text.tokenizer,
        transformer=reference,
    )


def run_pipeline(pipeline: FluxPipeline, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """noise [C, 1, h, w] -> (final latents [C, h, w], image [3, H, W] in [0, 1])."""
    channels, _, h, w = noise.shape
    final = {}

    def keep_latents(pipe, step, timestep, tensors):
        final["latents"] = tensors["latents"]
        return tensors

    image = pipeline(
        PROMPT,
        height=HEIGHT,
        width=WIDTH,
        num_inference_steps=STEPS,
        guidance_scale=GUIDANCE,
        latents=FluxPipeline._pack_latents(noise[None, :, 0], 1, channels, h, w),
        max_sequence_length=TEXT_LEN,
        output_type="pt",
        callback_on_step_end=keep_latents,
    ).images[0]
    latents = FluxPipeline._unpack_latents(final["latents"], HEIGHT, WIDTH, pipeline.vae_scale_factor)[0]
    return latents, image


def flux_pipeline_folder(tmp_path) -> Path:
    """The tiny encoders laid out as a FLUX.1-dev folder (CLIP in text_encoder/ + tokenizer/, T5 in
    text_encoder_2/ + tokenizer_2/, vae/): what the docs' --t5 / --clip / --vae FLUX.1-dev read."""
    paths = build_tiny_random_encoders(
        tmp_path / "tiny",
        text_dim=TINY["joint_attention_dim"],
        latent_channels=TINY["in_channels"] // 4,
        pooled_dim=TINY["pooled_projection_dim"],
    )
    root = tmp_path / "FLUX.1-tiny"
    layout = {"text_encoder": paths.clip_dir, "tokenizer": paths.clip_dir, "vae": paths.flux_vae_dir}
    layout |= {"text_encoder_2": paths.t5_dir, "tokenizer_2": paths.t5_dir}
    for name, folder in layout.items():
        shutil.copytree(folder, root / name)
    return root


def test_dfm_sampling_equals_fluxpipeline(tmp_path):
    reference = tiny_diffusers_flux()
    cfg, weights = dfm_config_and_weights(reference)
    model_cfg = dataclasses.replace(cfg.model, max_text_len=TEXT_LEN)
    cfg = dataclasses.replace(cfg, model=model_cfg, flow=dataclasses.replace(cfg.flow, dynamic_shift=True))
    cfg, _ = with_embedded_guidance(cfg, GUIDANCE)
    root = str(flux_pipeline_folder(tmp_path))
    encoders = load_encoders(EncoderSources(t5=root, vae=root, clip=root), TEXT_LEN, torch.device("cpu"))
    assert type(encoders.text.model).__name__ == "T5EncoderModel" and encoders.vae.kind == "kl"
    noise = draw_noise(latent_shape_for(encoders.vae, cfg.model, HEIGHT, WIDTH, 1), seed=3)
    args = Namespace(num_steps=STEPS, guidance_scale=GUIDANCE, sampler=None, seed=0, negative_prompt=None)
    with converted_model(cfg.model, weights, cfg.rng.seed) as model:
        latent = sample_prompt(model, cfg, encoders, PROMPT, noise, args, torch.device("cpu"))
    expected_latent, expected_image = run_pipeline(tiny_flux_pipeline(reference, encoders), noise)
    latent_diff = float((latent[:, 0] - expected_latent).abs().max())
    image = (encoders.vae.decode(latent[None])[0, :, 0] + 1) / 2  # [-1, 1] -> the pipeline's [0, 1]
    image_diff = float((image - expected_image).abs().max())
    print(f"FLUX sampling vs FluxPipeline: max abs diff latents {latent_diff:.2e}, decoded image {image_diff:.2e}")
    assert latent_diff <= 1e-5 and image_diff <= 1e-5
