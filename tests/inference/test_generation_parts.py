"""The pieces of generation, in-process and fast: shapes, batch layout, progress count, output checks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dfm.config.container import ModelConfig
from dfm.data.patchify import unpatchify
from dfm.diffusion.pipeline import SamplingOptions
from dfm.diffusion.registry import build_pipeline
from dfm.inference.generation_batch import draw_noise, generation_batch, latent_shape_for, null_text_batch
from dfm.inference.media import check_output_path, to_uint8_frames

WAN_LIKE = SimpleNamespace(
    spatial_compression=8,
    temporal_compression=4,
    latent_frames=lambda n: 1 + (n - 1) // 4,
    valid_num_frames=lambda n: n >= 1 and (n - 1) % 4 == 0,
)


def tiny_model_cfg(**kw) -> ModelConfig:
    return ModelConfig(in_channels=4, text_embed_dim=32, patch_spatial=2, **kw)


def test_latent_shape_follows_vae_compression():
    assert latent_shape_for(WAN_LIKE, tiny_model_cfg(), 64, 32, 17) == (4, 5, 8, 4)
    assert latent_shape_for(WAN_LIKE, tiny_model_cfg(), 64, 32, 1) == (4, 1, 8, 4)


@pytest.mark.parametrize("height, frames, message", [(40, 1, "multiples of 16"), (64, 4, "1 \\+ 4k")])
def test_latent_shape_rejects_bad_sizes(height, frames, message):
    with pytest.raises(ValueError, match=message):
        latent_shape_for(WAN_LIKE, tiny_model_cfg(), height, 64, frames)


def test_generation_batch_round_trips_the_noise():
    cfg = tiny_model_cfg()
    noise = draw_noise((4, 2, 4, 6), seed=3)
    text = torch.randn(7, 32)
    batch = generation_batch(noise, text, cfg)
    assert batch.latents.shape == (2 * 2 * 3, 4 * 2 * 2) and batch.context.shape == (7, 32)
    assert torch.equal(unpatchify(batch.latents, (4, 2, 4, 6), 1, 2), noise)
    assert torch.equal(draw_noise((4, 2, 4, 6), seed=3), noise)  # the seed fixes the noise
    null = null_text_batch(batch)
    assert null.context.abs().sum() == 0 and torch.equal(null.latents, batch.latents)


@pytest.mark.parametrize("name, sampler", [("edm", "heun"), ("edm", "euler"), ("flow", "euler"), ("flow", "heun")])
@pytest.mark.parametrize("guided", [False, True])
def test_progress_total_counts_every_model_call(name, sampler, guided):
    calls = []

    def net(x, c_noise, batch):
        calls.append(1)
        return torch.zeros_like(x)

    sample_ids = torch.zeros(6, dtype=torch.long)
    cond, uncond = {"batch": "text"}, ({"batch": "null"} if guided else None)
    pipeline = build_pipeline(name)
    pipeline.sample(net, (6, 4), sample_ids, SamplingOptions(4, guidance_scale=2.0, sampler=sampler), cond, uncond)
    assert len(calls) == pipeline.sampler(sampler).model_calls(4, guided)


def test_output_path_must_fit_the_frame_count():
    check_output_path("a.mp4", 5)
    check_output_path("a.png", 1)
    with pytest.raises(ValueError, match=".mp4"):
        check_output_path("a.png", 5)
    with pytest.raises(ValueError, match=".png"):
        check_output_path("a.mp4", 1)


def test_frames_are_uint8_thwc():
    video = torch.tensor([-1.0, 0.0, 1.0]).view(3, 1, 1, 1).expand(3, 2, 4, 5)
    frames = to_uint8_frames(video)
    assert frames.shape == (2, 4, 5, 3) and frames.dtype.name == "uint8"
    assert frames[0, 0, 0].tolist() == [0, 128, 255]
