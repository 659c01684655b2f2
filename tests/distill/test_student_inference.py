"""Generation and export of a DMD2 student: a checkpoint whose saved config has distill.enabled=true.

The student here is a tiny random diffusers Wan saved as a dfm checkpoint with a distill section
(no distillation run: what is tested is how a student checkpoint is sampled and exported, whatever its
weights). inference_dit_model.py's ``generate`` samples it at its own timesteps, unguided; the export loads
in WanPipeline, whose scheduler (the exported scheduler_config.json, the times set as the docs say) gives
dfm's samples: the dmd2 sampler with the same fresh noise, and the Euler one.
"""

from __future__ import annotations

import dataclasses
import json

import diffusers
import pytest
import torch

import dfm.distill.student_sampling as student_sampling
from dfm.config.container import ConfigContainer
from dfm.config.loader import set_key
from dfm.convert.cli import main as convert_main
from dfm.convert.pretrained import save_pretrained_checkpoint
from dfm.convert.rules import to_dfm
from dfm.convert.student_schedule import TIMESTEPS_KEY
from dfm.convert.wan import WAN, parity_samples, rules
from dfm.data.packing import pack_samples
from dfm.data.patchify import unpatchify
from dfm.diffusion.registry import pipeline_from_config
from dfm.inference import generate as generate_module
from dfm.inference.checkpoint_loading import (
    checkpoint_config,
    checkpoint_directory,
    load_model,
    single_process_config,
)
from dfm.inference.generate import generate, parse_args
from dfm.inference.student import DMD2, EULER, sample_student_latent
from tests.models.conftest import dist  # noqa: F401  (the one-process megatron state fixture)
from tests.wan._tiny import tiny_diffusers_wan, tiny_model_config
from tests.wan.test_wan_sampling import padded

TIMESTEPS = [1.0, 0.6, 0.3]  # not the default, so that reading them from the checkpoint is what is tested
TOLERANCE = 1e-4  # fp32, tiny model
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def student(tmp_path_factory, dist):  # noqa: F811
    """The root of a student checkpoint: the tiny random Wan, distill.enabled, TIMESTEPS."""
    cfg = ConfigContainer()
    cfg.model = tiny_model_config()
    for key, value in (("flow.c_noise_scale", 1000.0), ("distill.enabled", True), ("distill.guidance_scale", 3.0)):
        set_key(cfg, key, value)
    cfg.distill.student_timesteps = list(TIMESTEPS)
    root = tmp_path_factory.mktemp("student") / "ckpt"
    save_pretrained_checkpoint(cfg, to_dfm(tiny_diffusers_wan().state_dict(), rules(cfg.model)), root)
    return root


def generate_recording(root, out, monkeypatch, *flags: str) -> list[float]:
    """``generate`` of the student at ``root`` (tiny random encoders, one 32 x 32 frame) -> the times t
    (c_noise / 1000) of every model call."""
    seen: list[float] = []
    load = generate_module.load_model

    def recording_load(*args, **kwargs):
        model = load(*args, **kwargs)
        model.register_forward_pre_hook(lambda _, inputs: seen.extend((inputs[1] / 1000).tolist()))
        return model

    monkeypatch.setattr(generate_module, "load_model", recording_load)
    argv = ["--checkpoint_path", str(root), "--tiny_random_encoders", "--height", "32", "--width", "32"]
    assert generate(parse_args([*argv, "--video_save_path", str(out), *flags]), CPU).stat().st_size > 0
    return seen


@pytest.mark.parametrize("sampler", [None, EULER])
def test_a_student_checkpoint_samples_at_its_own_timesteps(student, tmp_path, monkeypatch, sampler):
    """No --num_steps, no --guidance_scale: one (unguided) model call at each stored time, for either sampler."""
    flags = [] if sampler is None else ["--sampler", sampler]
    seen = generate_recording(student, tmp_path / "student.png", monkeypatch, *flags)
    assert seen == pytest.approx(TIMESTEPS, abs=1e-6)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num_steps", "2"], r"distill\.student_timesteps=\[1\.0, 0\.6, 0\.3\]"),
        (["--guidance_scale", "3"], r"distill\.guidance_scale=3\.0\) is baked into it"),
        (["--negative_prompt", "blurry"], "samples unguided"),
        (["--sampler", "heun"], "dmd2 or euler"),
    ],
)
def test_what_a_student_cannot_do_is_refused_naming_the_key(student, tmp_path, flags, message):
    argv = ["--checkpoint_path", str(student), "--tiny_random_encoders", *flags]
    with pytest.raises(ValueError, match=message):
        generate(parse_args([*argv, "--video_save_path", str(tmp_path / "x.png")]), CPU)


@pytest.fixture(scope="module")
def exported(student, tmp_path_factory):
    """(the export folder of the student, the scheduler_config.json it holds)."""
    folder = tmp_path_factory.mktemp("export") / "wan_student"
    assert convert_main(WAN, ["export", "--checkpoint", str(student), "--output", str(folder)]) == 0
    return folder, json.loads((folder / "scheduler_config.json").read_text())


def loaded_student(root):
    """(the student's saved config, the dfm model loaded from its checkpoint as generate loads it)."""
    directory = checkpoint_directory(root)
    cfg = single_process_config(checkpoint_config(directory))
    return cfg, load_model(cfg, directory, CPU)


def student_wan_pipeline(folder) -> diffusers.WanPipeline:
    """WanPipeline of the exported folder, its scheduler on the student's times (the docs' recipe)."""
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(folder)
    sigmas = scheduler.config[TIMESTEPS_KEY]
    set_timesteps = scheduler.set_timesteps
    scheduler.set_timesteps = lambda num_inference_steps, device=None, **_: set_timesteps(sigmas=sigmas, device=device)
    transformer = diffusers.WanTransformer3DModel.from_pretrained(folder, torch_dtype=torch.float32)
    return diffusers.WanPipeline(
        tokenizer=None, text_encoder=None, vae=None, transformer=transformer, scheduler=scheduler
    )


def wan_pipeline_latents(pipe, start, noise) -> torch.Tensor:
    """``pipe``'s latents [C, T, H, W] from ``noise`` for ``start``'s text, unguided, over the student's times."""
    _, t, h, w = start.latent_shape
    with torch.no_grad():
        return pipe(
            prompt_embeds=padded(start.text),
            latents=noise[None],
            height=16 * h,
            width=16 * w,
            num_frames=4 * (t - 1) + 1,
            num_inference_steps=len(TIMESTEPS),
            guidance_scale=1.0,
            output_type="latent",
        ).frames[0]


def parity_start(cfg):
    """(a sample whose latent is the starting noise, that noise [C, T, H, W], its one-sample pack)."""
    (start,) = parity_samples(cfg.model, shapes=[((3, 4, 6), 5)])
    noise = unpatchify(start.tokens, start.latent_shape, cfg.model.patch_temporal, cfg.model.patch_spatial)
    return start, noise, pack_samples([start])


def test_export_carries_the_students_schedule(exported):
    _, config = exported
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(exported[0])
    assert config[TIMESTEPS_KEY] == TIMESTEPS and scheduler.config[TIMESTEPS_KEY] == TIMESTEPS
    assert (scheduler.config.shift, scheduler.config.stochastic_sampling) == (1.0, True)


@pytest.mark.filterwarnings("ignore")
def test_wan_pipeline_with_the_same_fresh_noise_gives_dfms_dmd2_samples(student, exported, monkeypatch):
    """The exported scheduler's stochastic step is the student's re-noising step: fed the fresh noise dfm
    drew (diffusers draws its own from torch's global generator), WanPipeline gives dfm's sample."""
    cfg, model = loaded_student(student)
    start, noise, pack = parity_start(cfg)
    drawn, draw = [], student_sampling.fresh_noise
    monkeypatch.setattr(student_sampling, "fresh_noise", lambda *a: drawn.append(draw(*a)) or drawn[-1])
    ours = sample_student_latent(model, pipeline_from_config(cfg), pack, cfg, DMD2, seed=0)
    assert len(drawn) == len(TIMESTEPS) - 1
    queued = [unpatchify(n, start.latent_shape, cfg.model.patch_temporal, cfg.model.patch_spatial)[None] for n in drawn]
    # diffusers draws at the last step too, where it is scaled by the next time, 0: zeros there.
    queued.append(torch.zeros_like(queued[0]))
    scheduler_module = diffusers.schedulers.scheduling_flow_match_euler_discrete
    monkeypatch.setattr(scheduler_module, "randn_tensor", lambda shape, **_: queued.pop(0).reshape(shape))
    theirs = wan_pipeline_latents(student_wan_pipeline(exported[0]), start, noise)
    assert not queued
    error = (ours - theirs).abs().max().item()
    print(f"dmd2 student vs WanPipeline (stochastic_sampling, same noise): {error:.2e}")
    assert error <= TOLERANCE, error


@pytest.mark.filterwarnings("ignore")
def test_wan_pipeline_gives_dfms_euler_samples_and_one_step_is_both(student, exported):
    """stochastic_sampling=False (diffusers' default Euler step) is dfm's --sampler euler over the same
    times; the two samplers differ for 3 steps and agree for one."""
    cfg, model = loaded_student(student)
    start, noise, pack = parity_start(cfg)
    flow = pipeline_from_config(cfg)
    ours = sample_student_latent(model, flow, pack, cfg, EULER, seed=0)
    pipe = student_wan_pipeline(exported[0])
    pipe.scheduler.register_to_config(stochastic_sampling=False)
    theirs = wan_pipeline_latents(pipe, start, noise)
    error = (ours - theirs).abs().max().item()
    print(f"euler student vs WanPipeline (Euler): {error:.2e}")
    assert error <= TOLERANCE, error
    assert (ours - sample_student_latent(model, flow, pack, cfg, DMD2, seed=0)).abs().max() > 100 * TOLERANCE
    one_step = dataclasses.replace(cfg, distill=dataclasses.replace(cfg.distill, student_timesteps=[1.0]))
    euler, dmd2 = (sample_student_latent(model, flow, pack, one_step, name, seed=0) for name in (EULER, DMD2))
    assert (euler - dmd2).abs().max().item() <= 1e-6
