"""The learning-parity harness (benchmarks/learning_parity.py): the reference trains dfm's flow objective and
samples as dfm's flow Euler does, and a tiny end-to-end run scores both sides."""

from __future__ import annotations

import io
import json
import pickle
import tarfile

import numpy as np
import pytest
import torch

from benchmarks.learning_parity import SCORE_COLUMNS, main
from benchmarks.learning_reference import (
    euler_sample,
    from_tokens,
    lr_factor,
    noised,
    read_clip_shards,
    to_tokens,
    training_times,
    velocity_target,
)
from dfm.config.container import ConfigContainer, SchedulerConfig
from dfm.data.patchify import patchify
from dfm.diffusion.flow import FlowPipeline, FlowSettings
from dfm.diffusion.samplers import classifier_free_guidance, flow_euler, flow_timesteps
from dfm.inference.encoders import EncoderSources, load_encoders


def test_reference_objective_is_dfms():
    """t, x_t and the target velocity from the reference's formulas equal dfm's flow pipeline's."""
    settings = FlowSettings(logit_mean=0.3, logit_std=0.8, shift=3.0, sigma_min=0.05)
    pipeline = FlowPipeline(settings)
    batch, length, dim = 5, 6, 4
    x0, noise = torch.randn(batch, length, dim), torch.randn(batch, length, dim)
    t = training_times(batch, settings, torch.Generator().manual_seed(7))
    assert torch.equal(t, pipeline.draw_t(batch, torch.Generator().manual_seed(7)))
    sample_ids = torch.arange(batch).repeat_interleave(length)
    packed = pipeline.interpolate(x0.flatten(0, 1), noise.flatten(0, 1), t, sample_ids)
    assert torch.allclose(noised(x0, noise, t, settings.sigma_min), packed.view(batch, length, dim), atol=1e-6)
    target = pipeline.target_velocity(x0, noise)
    assert torch.allclose(velocity_target(x0, noise, settings.sigma_min), target, atol=1e-6)


def test_reference_sampler_is_dfms_flow_euler():
    """Guided Euler over the shifted schedule, as dfm's flow_euler with classifier_free_guidance runs it."""
    cfg = ConfigContainer()
    cfg.flow = FlowSettings(shift=2.0, c_noise_scale=1000.0)
    x, text = torch.randn(3, 8, 4), torch.randn(3, 5, 4)
    mask = torch.ones(3, 1, 1, 5, dtype=torch.bool)

    def model(x, c_noise, pos_ids, text, mask):  # any smooth field of x, the level and the text
        return torch.tanh(x) * c_noise[:, None, None] / 1000 + text.mean(dim=1, keepdim=True)

    ours = euler_sample(model, x, None, (text, mask), cfg, steps=4, guidance=3.0)
    c = lambda t: torch.full((3,), 1000.0 * t)  # noqa: E731
    field = lambda x, t: classifier_free_guidance(  # noqa: E731
        model(x, c(t), None, text, mask), model(x, c(t), None, torch.zeros_like(text), mask), 3.0
    )
    assert torch.allclose(ours, flow_euler(field, x, flow_timesteps(4, 2.0)), atol=1e-6)


def test_tokens_are_dfms_patches():
    """The reference's dense tokens and positions are dfm's patchify of each latent, and invert."""
    latents = torch.randn(2, 1, 4, 16, 16)
    tokens, pos_ids = to_tokens(latents, 2, 4)
    for row, latent in enumerate(latents):
        expected_tokens, expected_pos = patchify(latent, 2, 4)
        assert torch.equal(tokens[row], expected_tokens) and torch.equal(pos_ids, expected_pos)
    assert torch.equal(from_tokens(tokens, (1, 4, 16, 16), 2, 4), latents)


@pytest.mark.slow
def test_both_sides_score_on_the_same_clips(tmp_path, capsys):
    """20 clips, 30 iterations, 2 sampling steps: both sides train and score (~75 s on 2 CPU cores; dfm's
    share is mostly its two child processes starting), the table prints, each side's learning curve has
    a point every 15 iterations, and the shards' text is what the sampler's T5 gives for the same caption."""
    argv = ["--out_dir", str(tmp_path), "--clips", "20", "--iterations", "30", "--samples_per_caption", "1"]
    summary = main([*argv, "--steps", "2", "--curve_every", "15"])
    out = capsys.readouterr().out
    assert "| dfm |" in out and "| reference |" in out
    for row in summary["rows"].values():
        assert all(0 <= row[key] <= 1 for key in SCORE_COLUMNS.values())
        assert [point["iteration"] for point in row["curve"]] == [15, 30]
        assert {k: row["curve"][-1][k] for k in SCORE_COLUMNS.values()} == {k: row[k] for k in SCORE_COLUMNS.values()}
    assert json.loads((tmp_path / "learning_parity.json").read_text())["rows"] == summary["rows"]
    shards = read_clip_shards(tmp_path / "dataset")
    assert len(shards.captions) == 20 and shards.latents.shape[1:] == (1, 4, 16, 16)
    sources = EncoderSources(t5=str(tmp_path / "t5"), vae=str(tmp_path / "vae"), vae_subfolder=None)
    encoded = load_encoders(sources, 40, torch.device("cpu")).text.encode(shards.captions[:3])
    for shard_text, text in zip(shards.texts, encoded):
        assert torch.allclose(shard_text, text.float().cpu(), atol=1e-5)


def test_reference_reads_every_shard_of_a_brace_pattern(tmp_path):
    """energon names a run of shards as one pattern in split.yaml; the reference reads them all."""
    for index in range(2):
        with tarfile.open(tmp_path / f"part-{index:06d}.tar", "w") as tar:
            latent, text = io.BytesIO(), pickle.dumps(np.full((3, 2), index, dtype=np.float32))
            torch.save(torch.full((1, 4, 16, 16), float(index)), latent)
            members = {"pth": latent.getvalue(), "pickle": text, "json": json.dumps({"caption": f"c{index}"}).encode()}
            for extension, data in members.items():
                info = tarfile.TarInfo(f"sample{index}.{extension}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    (tmp_path / ".nv-meta").mkdir()
    (tmp_path / ".nv-meta" / "split.yaml").write_text("split_parts:\n  train:\n  - part-{000000..000001}.tar\n")
    shards = read_clip_shards(tmp_path)
    assert shards.captions == ["c0", "c1"] and shards.latents[:, 0, 0, 0, 0].tolist() == [0.0, 1.0]
    assert [text[0, 0].item() for text in shards.texts] == [0.0, 1.0]


def test_a_curve_leaves_the_trained_weights_in_place():
    """Scoring the snapshots puts the final weights back: with ``state_dict()`` kept uncopied, the last
    snapshot's weights stayed loaded and the final row scored iteration 2500's (seen 2026-11-29)."""
    from benchmarks.learning_parity import snapshot_curve

    model = torch.nn.Linear(2, 1)
    final = model.weight.detach().clone()
    snapshots = {
        1: {"weight": torch.zeros(1, 2), "bias": torch.zeros(1)},
        2: {"weight": torch.ones(1, 2), "bias": torch.ones(1)},
    }
    scores = {key: 0.0 for key in SCORE_COLUMNS.values()}
    seen = []
    curve = snapshot_curve(model, snapshots, lambda m: seen.append(m.weight.sum().item()) or scores)
    assert seen == [0.0, 2.0] and [point["iteration"] for point in curve] == [1, 2]
    assert torch.equal(model.weight, final)


@pytest.mark.parametrize("style", ["constant", "cosine"])
def test_reference_schedule_is_megatrons_after_warm_up(style):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    lr, min_lr, warmup, iters = 2e-3, 1e-4, 20, 300
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    optimizer.param_groups[0]["weight_decay"] = 0.0
    megatron = OptimizerParamScheduler(optimizer, 0.0, lr, min_lr, warmup, iters, style, 0.0, 0.0, iters, "constant")
    factor = lr_factor(SchedulerConfig(lr_warmup_iters=warmup, lr_decay_style=style), lr, min_lr, iters)
    for step in range(warmup, iters + 5):
        megatron.num_steps = step
        assert factor(step) * lr == pytest.approx(megatron.get_lr(optimizer.param_groups[0]), rel=1e-12)
