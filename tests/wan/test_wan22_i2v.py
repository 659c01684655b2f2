"""Wan 2.2 I2V-A14B (``model.wan_image_condition``): the model reads each token's noisy latent and its
image condition (4 mask + the image latent's channels, 36 for the 14B), as diffusers'
WanTransformer3DModel reads cat([latents, condition]) on channels:

* a pack of three samples equals diffusers on each alone (outputs, gradients), fp32;
* a two-transformer WanImageToVideoPipeline folder imports to two expert checkpoints and exports
  back bit for bit, as a folder WanImageToVideoPipeline.from_pretrained loads; inference_dit_model.py
  generates from the imports with --image (and refuses without one);
* generation from an image (both experts, --image's code) gives WanImageToVideoPipeline's latents;
* the preset's parameter count is diffusers' for the published config;
* preparation stores each clip's image-condition latent, the loader's packs carry it, and a training
  step on them has a finite loss and gradients on the condition channels' weights; the entry point
  fine-tunes the low-noise expert's import on such data.
"""

import dataclasses
import io
import json
import math

import diffusers
import pytest
import torch
import webdataset as wds
from PIL import Image

from dfm.config.container import ModelConfig
from dfm.config.presets import PRESETS
from dfm.convert.pretrained import read_full_weights
from dfm.convert.wan import parity_samples, parity_timesteps
from dfm.data.encoders.tiny import build_tiny_wan_vae
from dfm.data.encoders.vae import VideoVAE
from dfm.data.energon.data_module import EnergonDataSettings, build_train_loader
from dfm.data.energon.task_encoder import PackingSettings
from dfm.data.packing import pack_samples
from dfm.data.patchify import unpatchify
from dfm.diffusion.pipeline import SamplingOptions
from dfm.diffusion.registry import build_pipeline
from dfm.diffusion.timestep_experts import TimestepExperts
from dfm.inference.checkpoint_loading import checkpoint_config, checkpoint_directory
from dfm.inference.generate import generate, parse_args
from dfm.inference.generation_batch import generation_batch
from dfm.inference.image_condition import image_condition_latent
from dfm.inference.sampling import sample_latent
from dfm.models.presets_cli import preset_parameter_counts
from dfm.models.wan.flops import wan_forward_flops
from dfm.training.forward_step import DiffusionForwardStep
from tests.training.entry import read_metrics, run_entry
from tests.wan._tiny import (
    TINY,
    TINY_I2V,
    dfm_wan_of,
    diffusers_reference,
    parity_errors,
    tiny_diffusers_wan,
    tiny_model_config,
)
from tests.wan.test_wan22_experts import TINY_TEXT, WAN_TINY, export_bit_exact, run_cli
from tests.wan.test_wan_convert import finetune_overrides, prepare_with_wan_encoders
from tests.wan.test_wan_sampling import GUIDANCE, SHIFT, STEPS, TOLERANCE, pipeline_latents, wan_pipeline

BOUNDARY = 0.9  # Wan2.2-I2V-A14B's; 4 steps at shift 5: t = 1, 0.94 (high noise), 0.83, 0.62 (low noise)
GUIDANCE_2 = 3.0
FORWARD_TOLERANCE, GRAD_TOLERANCE = 1e-5, 1e-4


def experts():
    """(high-noise, low-noise) tiny random diffusers I2V transformers."""
    return tiny_diffusers_wan(seed=0, config=TINY_I2V), tiny_diffusers_wan(seed=1, config=TINY_I2V)


@pytest.fixture(scope="module")
def cfg():
    model = tiny_model_config(TINY_I2V)
    assert (model.in_channels, model.out_channels, model.wan_image_condition) == (4, 4, True)
    return model


def test_i2v_pack_matches_diffusers_outputs_and_gradients(cfg, dist):
    transformer = experts()[0]
    model = dfm_wan_of(transformer, cfg)
    samples = parity_samples(cfg)
    batch, timesteps = pack_samples(samples, segment_multiple=4), parity_timesteps(len(samples))
    error, grad_errors = parity_errors(
        model, cfg, batch, timesteps, diffusers_reference(transformer, samples, timesteps)
    )
    print(f"I2V forward parity: {error:.2e}")
    assert error <= FORWARD_TOLERANCE
    assert all(e <= GRAD_TOLERANCE for e in grad_errors.values()), grad_errors
    # The condition channels are read: their patch-embedding weights get gradients, and the output moves with them.
    assert transformer.patch_embedding.weight.grad[:, 4:].abs().max() > 0
    other = dataclasses.replace(batch, image_condition=torch.randn_like(batch.image_condition))
    with torch.no_grad():
        assert (model(batch.latents, timesteps, other) - model(batch.latents, timesteps, batch)).abs().max() > 1e-3


@pytest.fixture(scope="module")
def i2v_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("i2v") / "pipeline"
    for transformer, name in zip(experts(), ("transformer", "transformer_2")):
        transformer.save_pretrained(folder / name)
    index = {"_class_name": "WanImageToVideoPipeline", "boundary_ratio": BOUNDARY, "image_encoder": [None, None]}
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


@pytest.fixture(scope="module")
def imported(i2v_folder):
    """The checkpoint root the import (with --verify) wrote: <root>/high_noise, <root>/low_noise."""
    ckpt = i2v_folder.parent / "ckpt"
    run_cli(["import", "--diffusers", i2v_folder, "--output", ckpt, "--verify", *TINY_TEXT])
    return ckpt


def test_i2v_two_expert_folder_round_trip_is_bit_exact_loads_and_generates(i2v_folder, imported, tmp_path, dist):
    ckpt = imported
    for expert in ("high_noise", "low_noise"):
        model = checkpoint_config(checkpoint_directory(ckpt / expert)).model
        assert (model.wan_expert, model.wan_boundary_ratio, model.wan_image_condition) == (expert, BOUNDARY, True)
        assert (model.in_channels, model.out_channels) == (4, 4)
    export_bit_exact(i2v_folder, ckpt, tmp_path / "out")
    for name in ("transformer", "transformer_2"):
        config = json.loads((tmp_path / "out" / name / "config.json").read_text())
        assert (config["in_channels"], config["out_channels"], config["image_dim"]) == (12, 4, None)
    absent = dict.fromkeys(("tokenizer", "text_encoder", "vae", "scheduler", "image_encoder", "image_processor"))
    pipe = diffusers.WanImageToVideoPipeline.from_pretrained(tmp_path / "out", torch_dtype=torch.float32, **absent)
    assert pipe.config.boundary_ratio == BOUNDARY and not pipe.config.expand_timesteps
    high, low = experts()
    assert torch.equal(pipe.transformer.patch_embedding.weight, high.patch_embedding.weight)
    assert torch.equal(pipe.transformer_2.patch_embedding.weight, low.patch_embedding.weight)
    # inference_dit_model.py from the imports: --image conditions both experts, --guidance_scale_2 the low-noise one.
    Image.new("RGB", (48, 32), (200, 30, 90)).save(tmp_path / "image.png")
    args = [
        "--checkpoint_path",
        ckpt / "high_noise",
        "--checkpoint_path_2",
        ckpt / "low_noise",
        "--tiny_random_encoders",
    ]
    args += [
        "--num_video_frames",
        "5",
        "--height",
        "32",
        "--width",
        "48",
        "--num_steps",
        "2",
        "--guidance_scale_2",
        "2",
    ]
    video = tmp_path / "i2v.mp4"
    cpu = torch.device("cpu")  # generate() is main() without its process group (the `dist` fixture's)
    assert generate(
        parse_args([str(a) for a in [*args, "--image", tmp_path / "image.png", "--video_save_path", video]]), cpu
    )
    assert video.stat().st_size > 0
    with pytest.raises(ValueError, match="pass --image"):
        generate(parse_args([str(a) for a in args]), cpu)


@pytest.mark.filterwarnings("ignore")
def test_i2v_generation_from_an_image_matches_wan_image_to_video_pipeline(cfg, tmp_path, dist):
    """Both experts (guidance GUIDANCE, then GUIDANCE_2), the image condition from --image's code on a
    tiny random Wan VAE, against WanImageToVideoPipeline(transformer, transformer_2, boundary_ratio)."""
    vae_folder = build_tiny_wan_vae(tmp_path / "vae", 0, TINY["out_channels"])
    vae = VideoVAE.from_pretrained_or_cache(vae_folder, kind="wan")
    net = TimestepExperts(*(dfm_wan_of(t, cfg) for t in experts()), boundary=1000.0 * BOUNDARY)
    start, negative = parity_samples(cfg, shapes=[((3, 4, 6), 5), ((3, 4, 6), 3)])
    noise = unpatchify(start.tokens, start.latent_shape, cfg.patch_temporal, cfg.patch_spatial)
    _, t, h, w = start.latent_shape
    height, width, frames = 8 * h, 8 * w, 4 * (t - 1) + 1
    pixels = (torch.rand(height, width, 3, generator=torch.Generator().manual_seed(3)) * 255).to(torch.uint8)
    Image.fromarray(pixels.numpy()).save(tmp_path / "image.png")
    condition = image_condition_latent(vae, tmp_path / "image.png", height, width, frames)
    assert condition.shape == start.latent_shape
    pack = generation_batch(noise, start.text, cfg, image_condition=condition)
    uncond = generation_batch(noise, negative.text, cfg, image_condition=condition)
    flow = build_pipeline("flow", c_noise_scale=1000.0, shift=SHIFT)
    options = SamplingOptions(STEPS, GUIDANCE, "euler", guidance_scale_2=GUIDANCE_2, guidance_boundary=BOUNDARY)
    ours = sample_latent(net, flow, pack, cfg, options, uncond=uncond)
    high, low = experts()
    pipe = wan_pipeline(
        high, pipeline=diffusers.WanImageToVideoPipeline, transformer_2=low, boundary_ratio=BOUNDARY, vae=vae.model
    )
    image = Image.open(tmp_path / "image.png")
    theirs = pipeline_latents(pipe, start, negative, noise, spatial=8, image=image, guidance_scale_2=GUIDANCE_2)
    error = (ours - theirs).abs().max().item()
    print(f"I2V generation parity: {error:.2e}")
    assert error <= TOLERANCE


def test_i2v_a14b_preset_counts_what_diffusers_builds():
    """The published Wan2.2-I2V-A14B transformer config (in 36, out 16, no image embedder), on the meta device."""
    config = dict(TINY, num_attention_heads=40, attention_head_dim=128, in_channels=36, out_channels=16)
    config |= dict(text_dim=4096, ffn_dim=13824, num_layers=40, image_dim=None)
    with torch.device("meta"):
        reference = sum(p.numel() for p in diffusers.WanTransformer3DModel(**config).parameters())
    assert reference == 14_288_901_184
    assert preset_parameter_counts(["Wan2.2-I2V-A14B"]) == {"Wan2.2-I2V-A14B": reference}
    # Its forward FLOPs count the 20 condition channels' patch embedding: 2 n h x 20 x 4 more than T2V's.
    i2v, t2v = (ModelConfig(**PRESETS[name]) for name in ("Wan2.2-I2V-A14B", "Wan2.2-T2V-A14B"))
    assert wan_forward_flops(i2v, [1000], [10]) - wan_forward_flops(t2v, [1000], [10]) == 2 * 1000 * 5120 * 20 * 4


@pytest.fixture(scope="module")
def i2v_shards(tmp_path_factory):
    """prepare_energon_dataset.py --wan_image_condition with a tiny Wan pipeline folder's UMT5 (24-d) and VAE."""
    return prepare_with_wan_encoders(tmp_path_factory.mktemp("i2v_data"), "--wan_image_condition")


def test_prepared_image_conditions_train_the_condition_channels(i2v_shards, dist):
    """prepare_energon_dataset.py --wan_image_condition (a tiny Wan VAE, 4 channels) stores each clip's
    image-condition latent; the energon loader's packs carry its tokens; one training step of a tiny
    I2V model on such a pack has a finite loss and gradients on the condition channels' weights."""
    shards = wds.WebDataset([str(p) for p in sorted(i2v_shards.glob("*.tar"))], shardshuffle=False)
    for sample in shards:
        latent = torch.load(io.BytesIO(sample["pth"]), weights_only=True)
        condition = torch.load(io.BytesIO(sample["image_condition.pth"]), weights_only=True)
        assert condition.shape == latent.shape == (4, 2, 4, 6)
        # The causal VAE's first latent frame is the first frame's alone; the later ones are the zero frames'.
        assert (condition[:, 0] - latent[:, 0]).abs().max() <= 1e-5 < (condition[:, 1] - latent[:, 1]).abs().max()
    packing = PackingSettings(seq_length=64, max_text_len=16, in_channels=4)
    settings = EnergonDataSettings(path=str(i2v_shards), packing=packing, num_workers=0)
    batch = next(build_train_loader(settings, dp_rank=0, dp_size=1))
    assert batch.image_condition.shape == (batch.seq_len, 4 * (4 + 4))
    first_frame = batch.pos_ids[:, 0] == 0
    mask = batch.image_condition.unflatten(1, (4, 8))[:, :, :4]  # per patch position: mask, then latent
    assert bool((mask[first_frame] == 1).all()) and bool((mask[~first_frame] == 0).all())
    cfg = tiny_model_config(TINY_I2V, max_text_len=16)
    model = dfm_wan_of(experts()[0], cfg)
    step = DiffusionForwardStep(
        build_pipeline("flow", c_noise_scale=1000.0), seed=0, cfg_dropout_prob=0.0, device=torch.device("cpu")
    )
    output, loss_fn = step.run(model, *step.prepare(batch))
    loss, _ = loss_fn(output)
    loss.backward()
    assert torch.isfinite(loss)
    grad = model.x_embedder.weight.grad.unflatten(1, (4, 12))  # [h, positions, 4 latent + 4 mask + 4 image]
    assert grad[:, :, 4:].abs().amax() > 0 and bool(torch.isfinite(grad).all())


@pytest.mark.slow
def test_entry_point_fine_tunes_the_low_noise_i2v_expert_on_prepared_data(imported, i2v_shards, tmp_path):
    """pretrain_dit_model.py (one process) from the low-noise import on the --wan_image_condition shards:
    3 iterations, finite losses, and the patch embedding's condition columns move."""
    run = tmp_path / "run"
    overrides = [*finetune_overrides(i2v_shards, imported / "low_noise", run), "model.wan_expert=low_noise"]
    overrides += [f"model.wan_boundary_ratio={BOUNDARY}", "model.wan_image_condition=true", "optimizer.lr=1e-3"]
    overrides += TINY_TEXT
    result = run_entry(1, overrides, config=WAN_TINY, mock=False)
    assert result.returncode == 0, result.stderr[-4000:]
    losses = [m["loss"] for m in read_metrics(run / "logs")]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
    _, trained = read_full_weights(run / "checkpoints")
    _, initial = read_full_weights(imported / "low_noise")
    moved = (trained["x_embedder.weight"] - initial["x_embedder.weight"]).unflatten(1, (4, 12))[:, :, 4:]
    assert moved.abs().amax() > 1e-4
