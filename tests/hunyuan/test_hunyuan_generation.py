"""Generation: dfm's HunyuanVideo 1.5 sampling (dfm/inference/hunyuan.py: the pipeline's encoders,
Euler on the shifted sigmas, classifier-free guidance against the empty negative prompt) gives the
latents diffusers' HunyuanVideo15Pipeline (text-to-video) and HunyuanVideo15ImageToVideoPipeline
(image-to-video) give from the same tiny random weights, encoders and noise."""

from __future__ import annotations

import dataclasses

import diffusers
import numpy as np
import PIL.Image
import pytest
import torch
from diffusers.guiders import ClassifierFreeGuidance

from dfm.convert.weights import converted_model
from dfm.data.encoders.hunyuan import HunyuanEncoders, build_tiny_hunyuan_encoders
from dfm.inference.hunyuan import HunyuanRequest, sample_hunyuan
from tests.hunyuan._tiny import dfm_config_and_weights, tiny_diffusers_hunyuan

STEPS, GUIDANCE, SHIFT, FRAMES, HEIGHT, WIDTH = 3, 4.0, 5.0, 5, 32, 48
PROMPT = 'a sign reading "HELLO" in the rain'
# Shorter than the pipelines' (1000, 256, 729): diffusers runs the padding through the model.
QWEN_LEN, BYT5_LEN, IMAGE_TOKENS = 448, 16, 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    reference = tiny_diffusers_hunyuan()
    cfg, weights = dfm_config_and_weights(reference)
    cfg = dataclasses.replace(cfg, flow=dataclasses.replace(cfg.flow, shift=SHIFT))
    folder = build_tiny_hunyuan_encoders(tmp_path_factory.mktemp("encoders"))
    encoders = HunyuanEncoders.from_folder(folder, qwen_max_length=QWEN_LEN, byt5_max_length=BYT5_LEN)
    return reference, cfg, weights, encoders


def diffusers_pipeline(kind, reference, encoders):
    e = encoders
    common = dict(
        text_encoder=e.qwen,
        tokenizer=e.qwen_tokenizer,
        transformer=reference,
        vae=e.vae,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=SHIFT),
        text_encoder_2=e.byt5,
        tokenizer_2=e.byt5_tokenizer,
        guider=ClassifierFreeGuidance(guidance_scale=GUIDANCE),
    )
    if kind == "t2v":
        pipeline = diffusers.HunyuanVideo15Pipeline(**common)
    else:
        pipeline = diffusers.HunyuanVideo15ImageToVideoPipeline(
            **common, image_encoder=e.siglip, feature_extractor=e.siglip_processor
        )
    pipeline.target_size = 40  # the image's (H, W) bucket: 32 x 48 pixels for the 32 x 48 image
    pipeline.tokenizer_max_length, pipeline.tokenizer_2_max_length = QWEN_LEN, BYT5_LEN
    pipeline.vision_num_semantic_tokens = IMAGE_TOKENS  # t2v: its all-zero (masked) image tokens
    return pipeline


@pytest.mark.parametrize("kind", ["t2v", "i2v"])
def test_dfm_sampling_equals_the_diffusers_pipeline(setup, kind):
    reference, cfg, weights, encoders = setup
    pipeline = diffusers_pipeline(kind, reference, encoders)
    scale = encoders.vae.spatial_compression_ratio
    noise = torch.randn(
        4, (FRAMES - 1) // 4 + 1, HEIGHT // scale, WIDTH // scale, generator=torch.Generator().manual_seed(3)
    )
    image = None
    kwargs = dict(
        prompt=PROMPT, num_frames=FRAMES, num_inference_steps=STEPS, latents=noise[None], output_type="latent"
    )
    if kind == "i2v":
        pixels = (torch.rand(HEIGHT, WIDTH, 3, generator=torch.Generator().manual_seed(4)) * 255).to(torch.uint8)
        image = PIL.Image.fromarray(np.asarray(pixels))
        assert pipeline.video_processor.calculate_default_height_width(HEIGHT, WIDTH, pipeline.target_size) == (
            HEIGHT,
            WIDTH,
        )
        kwargs["image"] = image
    else:
        kwargs.update(height=HEIGHT, width=WIDTH)
    with torch.no_grad():
        expected = pipeline(**kwargs).frames[0]
    with converted_model(cfg.model, weights, cfg.rng.seed) as model:
        latent = sample_hunyuan(model, cfg, encoders, HunyuanRequest(PROMPT, noise, STEPS, GUIDANCE, image))
    diff = float((latent - expected).abs().max())
    print(f"HunyuanVideo 1.5 {kind} sampling vs diffusers: max abs diff latents {diff:.2e}")
    assert float(expected.abs().max()) > 0.1 and diff <= 1e-4
