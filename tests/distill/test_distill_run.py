"""DMD2 distillation through the trainer (distill.enabled; docs/distillation.md), one process.

A flow teacher is trained for 2 iterations through the real entry point (``--mock``, the tiny DiT); then
distilled for 4 iterations (``critic_steps=2``: the student steps at 2 and 4, the critic at every one;
teacher guidance 2, so the unconditional pass runs) saving at 2, and resumed from that checkpoint; the same
for a 1-step student with the regression loss on (``REGRESSION``) and with the GAN loss (``GAN``); and a run
with validation (``VALIDATION``), and one keeping the student's EMA with its resume. All ten runs share one
launch (tests/training/entry.py ``run_in_one_launch``). The teacher's freezing is checked in this process on
the trainer's own objects; the refusals on the config the entry point builds.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from dfm.config.errors import ConfigError
from dfm.config.loader import build_config
from dfm.diffusion.registry import pipeline_from_config
from dfm.distill import Packing
from dfm.distill.collapse import same_shape_samples
from dfm.distill.settings import DistillSettings
from dfm.inference.checkpoint_loading import checkpoint_config, checkpoint_directory, load_model, single_process_config
from dfm.inference.generation_batch import draw_noise, generation_batch
from dfm.inference.student import DMD2, sample_student_latent
from dfm.parallel import ParallelLayout
from dfm.training.distill_loop import DistillPlayers
from tests.training.entry import TINY, read_metrics, run_in_one_launch

FLOW = ["model.pipeline=flow"]
DISTILL = [*FLOW, "distill.enabled=true", "distill.critic_steps=2", "distill.guidance_scale=2", "train.train_iters=4"]
# A 1-step student (its every pack regresses) with DMD's regression onto 3-step teacher samples.
REGRESSION = ["distill.student_timesteps=[1.0]", "distill.regression_weight=0.5", "distill.regression_teacher_steps=3"]
# DMD2's GAN loss: the critic's classifier trained at weight 0.5, the student's generator loss at 0.2.
GAN = ["distill.gan_critic_weight=0.5", "distill.gan_student_weight=0.2"]
# Validation every 2 iterations: both players' losses at 2 levels, the student's sample of the first validation
# pack's text, and a decoded prompt (tiny random encoders).
PROMPT = "a red cat"
# The student's EMA (optimizer.ema_decay), updated at its steps (iterations 2 and 4).
EMA_DECAY = 0.75
VALIDATION = [
    "train.eval_interval=2",
    "train.eval_iters=1",
    "train.eval_noise_bins=2",
    f'validation.prompts=["{PROMPT}"]',
    "validation.tiny_random_encoders=true",
]


def distill_overrides(teacher: Path) -> list[str]:
    return [*DISTILL, f"checkpoint.pretrained={teacher}"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The teacher's checkpoint and the metrics of the straight and the resumed distillation."""
    tmp = tmp_path_factory.mktemp("distill")
    teacher, save = tmp / "teacher", tmp / "distill"
    teach = [*FLOW, "train.train_iters=2", f"checkpoint.save={teacher}", f"logger.log_dir={tmp / 'teacher_logs'}"]
    runs = [teach]
    for prefix, extra in (("", []), ("regression_", REGRESSION), ("gan_", GAN)):
        save = tmp / f"{prefix}distill"
        straight = [*distill_overrides(teacher), *extra, f"checkpoint.save={save}", "checkpoint.save_interval=2"]
        resumed = [*distill_overrides(teacher), *extra, f"checkpoint.load={save}/iter_0000002"]
        runs += [[*straight, f"logger.log_dir={tmp / f'{prefix}straight'}"]]
        runs += [[*resumed, f"logger.log_dir={tmp / f'{prefix}resumed'}"]]
    validated = [*distill_overrides(teacher), *VALIDATION, f"checkpoint.save={tmp / 'validated_ckpt'}"]
    runs += [[*validated, f"logger.log_dir={tmp / 'validated'}"]]
    ema = [*distill_overrides(teacher), f"optimizer.ema_decay={EMA_DECAY}", "checkpoint.save_interval=2"]
    runs += [[*ema, f"checkpoint.save={tmp / 'ema_ckpt'}", f"logger.log_dir={tmp / 'ema'}"]]
    resumed_ema = [f"checkpoint.load={tmp / 'ema_ckpt'}/iter_0000002", f"checkpoint.save={tmp / 'ema_resumed_ckpt'}"]
    runs += [[*ema, *resumed_ema, f"logger.log_dir={tmp / 'ema_resumed'}"]]
    run_in_one_launch(1, runs, tmp / "launch")
    names = tuple(f"{prefix}{run}" for prefix in ("", "regression_", "gan_") for run in ("straight", "resumed"))
    records = {name: {r["iteration"]: r for r in read_metrics(tmp / name)} for name in names}
    return teacher, records, tmp


@pytest.mark.slow
def test_both_players_losses_are_finite_and_logged(runs):
    _, records, _ = runs
    straight = records["straight"]
    assert sorted(straight) == [1, 2, 3, 4]
    for iteration, record in straight.items():
        assert math.isfinite(record["critic_loss"]) and record["critic_grad_norm"] is not None, record
        # the student steps every critic_steps-th iteration; the line carries its latest step
        expected = None if iteration == 1 else 2 * (iteration // 2)
        assert record["student_iteration"] == expected, record
        assert (record["student_loss"] is None) == (expected is None), record
        assert record["student_loss"] is None or math.isfinite(record["student_loss"])
        assert record["collapse_std"] > 0 and record["collapse_diversity"] > 0, record
    assert straight[4]["student_loss"] != straight[2]["student_loss"]
    # The teacher's diversity, measured once at the first iteration: the same number on every line.
    assert len({record["teacher_diversity"] for record in straight.values()}) == 1
    assert straight[1]["teacher_diversity"] > 0


def test_a_collapsing_student_is_warned_about_once_until_it_recovers(caplog):
    """distill.collapse_warning: below that fraction of the teacher's diversity, one warning; again only after
    the student was above it in between; never at 0 (off)."""
    players = DistillPlayers(DistillSettings(), {}, collapse_warning=0.5)
    players.teacher_diversity = 0.8
    with caplog.at_level("WARNING", logger="dfm.train"):
        for iteration, diversity in enumerate([0.6, 0.3, 0.2, 0.5, 0.35, None], start=1):
            players.warn_if_collapsing({"iteration": iteration, "collapse_diversity": diversity})
    warned = [record.getMessage() for record in caplog.records]
    assert len(warned) == 2 and warned[0].startswith("iteration 2: the student's sample diversity 0.3 is below 0.5")
    assert warned[1].startswith("iteration 5:") and "teacher's (0.8)" in warned[1]
    caplog.clear()
    off = DistillPlayers(DistillSettings(), {}, collapse_warning=0.0)
    off.teacher_diversity = 0.8
    off.warn_if_collapsing({"iteration": 1, "collapse_diversity": 0.01})
    assert not caplog.records


@pytest.mark.slow
@pytest.mark.parametrize("prefix", ["", "regression_", "gan_"])
def test_resume_is_exact(runs, prefix):
    """The GAN run's checkpoint holds the critic's classifier: resumed, its losses go on bitwise too."""
    _, records, _ = runs
    straight, resumed = records[f"{prefix}straight"], records[f"{prefix}resumed"]
    assert sorted(resumed) == [3, 4]
    keys = ("critic_loss", "critic_grad_norm", "collapse_diversity", "critic_gan_loss")
    student_keys = ("student_loss", "student_grad_norm", "student_regression_loss", "student_gan_loss")
    for iteration in resumed:
        for key in keys:
            assert resumed[iteration][key] == straight[iteration][key], (key, iteration)  # bitwise on CPU
    for key in student_keys:  # the student's step at 4 used the resumed critic and the resumed student
        assert resumed[4][key] == straight[4][key], key


@pytest.mark.slow
def test_the_regression_loss_is_logged_with_the_students_step(runs):
    """Off (the default): null on every line. On (a 1-step student): finite and positive from the student's
    first step on, carried like its loss until the next; part of the student's loss, not of the critic's."""
    _, records, _ = runs
    assert all(record["student_regression_loss"] is None for record in records["straight"].values())
    regression = records["regression_straight"]
    assert [regression[i]["student_regression_loss"] is None for i in (1, 2, 3, 4)] == [True, False, False, False]
    assert regression[3]["student_regression_loss"] == regression[2]["student_regression_loss"]
    for iteration in (2, 4):  # student loss = DMD's (>= 0) + 0.5 x regression
        record = regression[iteration]
        assert (
            record["student_regression_loss"] > 0 and record["student_loss"] >= 0.5 * record["student_regression_loss"]
        )
    assert all(math.isfinite(regression[i]["critic_loss"]) for i in regression)


@pytest.mark.slow
def test_the_gan_losses_are_logged_with_each_players_step(runs):
    """Off (the default): null on every line. On: the critic's classifier loss on every line, the student's
    generator loss from its first step on (carried until the next); each is part of its player's loss. At
    the start the classifier knows nothing: its loss is near 2 log 2 (logits near 0), the student's near log 2."""
    _, records, _ = runs
    assert all(r["critic_gan_loss"] is None and r["student_gan_loss"] is None for r in records["straight"].values())
    gan = records["gan_straight"]
    assert [gan[i]["student_gan_loss"] is None for i in (1, 2, 3, 4)] == [True, False, False, False]
    assert gan[3]["student_gan_loss"] == gan[2]["student_gan_loss"]
    assert math.isclose(gan[1]["critic_gan_loss"], 2 * math.log(2), rel_tol=0.1), gan[1]
    # After the classifier's one step the student's logits are still small: one draw, so a wide bound (seen:
    # 0.742 and, once packs put equal lengths side by side and the pack's draws fell to other samples, 0.884).
    assert math.isclose(gan[2]["student_gan_loss"], math.log(2), rel_tol=0.35), gan[2]
    for iteration, record in gan.items():
        assert record["critic_loss"] > 0.5 * record["critic_gan_loss"], record  # flow loss (> 0) + 0.5 x GAN
        if iteration in (2, 4):
            assert record["student_loss"] >= 0.2 * record["student_gan_loss"], record
    # the same draws but for the GAN's: the critic's first step differs from the plain run's by the GAN term
    assert gan[1]["critic_loss"] != records["straight"][1]["critic_loss"]


@pytest.mark.slow
def test_validation_logs_both_players_losses_and_the_students_pictures(runs):
    """train.eval_interval in a distillation: the student's and the critic's losses per level (two models: other
    numbers), and the prompt's decoded sample, at every evaluation."""
    _, _, tmp = runs
    lines = [json.loads(line) for line in (tmp / "validated" / "validation.jsonl").read_text().splitlines()]
    assert [record["iteration"] for record in lines] == [2, 4]
    for record in lines:
        keys = [f"val_loss{player}{level}" for player in ("", "_critic") for level in ("", "_t0", "_t1")]
        assert all(math.isfinite(record[key]) for key in keys), record
        assert record["val_loss_critic_t0"] != record["val_loss_t0"], record
        (picture,) = record["samples"]
        assert Path(picture).is_file() and Path(picture).name.endswith(".png")


@pytest.mark.slow
def test_the_validation_sample_is_the_students_own(runs):
    """The latent validation generated at iteration 4 is what the saved student samples at its own timesteps
    (the dmd2 sampler, as inference_dit_model.py samples a student) from the same noise and text."""
    from dfm.platform.distributed import destroy_distributed, initialize_distributed

    _, _, tmp = runs
    saved = torch.load(tmp / "validated_ckpt" / "validation_generation" / "iter_0000004_dp0.pt")
    directory = checkpoint_directory(tmp / "validated_ckpt")
    cfg = single_process_config(checkpoint_config(directory))
    initialize_distributed()
    try:
        model = load_model(cfg, directory, torch.device("cpu"))
        noise = draw_noise(tuple(saved["latent"].shape), cfg.rng.seed)
        batch = generation_batch(noise, saved["text"], cfg.model)
        latent = sample_student_latent(model, pipeline_from_config(cfg), batch, cfg, DMD2, cfg.rng.seed)
    finally:
        destroy_distributed()
    torch.testing.assert_close(latent, saved["latent"], rtol=1e-5, atol=1e-5)


def checkpoint_weights(directory: Path, use_ema: bool) -> dict[str, torch.Tensor]:
    """The student's weights (or its EMA) of the checkpoint ``directory``, loaded as inference loads them."""
    from dfm.platform.distributed import destroy_distributed, initialize_distributed

    cfg = single_process_config(checkpoint_config(checkpoint_directory(directory)))
    initialize_distributed()
    try:
        model = load_model(cfg, checkpoint_directory(directory), torch.device("cpu"), use_ema=use_ema)
        return {name: p.detach().clone() for name, p in model.named_parameters()}
    finally:
        destroy_distributed()


@pytest.mark.slow
def test_the_students_ema_follows_its_steps_and_resumes_exactly(runs):
    """optimizer.ema_decay in a distillation: the student's EMA starts at the teacher's weights and is updated
    at each student step only (2 and 4: d * ema + (1 - d) * w); a run resumed at 2 ends with the same EMA."""
    teacher_dir, _, tmp = runs
    teacher = checkpoint_weights(teacher_dir / "iter_0000002", use_ema=False)
    student = {i: checkpoint_weights(tmp / "ema_ckpt" / f"iter_{i:07d}", use_ema=False) for i in (2, 4)}
    ema = {i: checkpoint_weights(tmp / "ema_ckpt" / f"iter_{i:07d}", use_ema=True) for i in (2, 4)}
    resumed = checkpoint_weights(tmp / "ema_resumed_ckpt" / "iter_0000004", use_ema=True)
    moved = 0
    for name, start in teacher.items():
        after_2 = EMA_DECAY * start + (1 - EMA_DECAY) * student[2][name]
        torch.testing.assert_close(ema[2][name], after_2, rtol=1e-6, atol=1e-7, msg=name)
        after_4 = EMA_DECAY * ema[2][name] + (1 - EMA_DECAY) * student[4][name]
        torch.testing.assert_close(ema[4][name], after_4, rtol=1e-6, atol=1e-7, msg=name)
        assert torch.equal(resumed[name], ema[4][name]), name
        moved += int(not torch.equal(ema[4][name], student[4][name]))
    assert moved > 0


@pytest.mark.slow
def test_teacher_is_frozen_and_the_players_learn(runs, tmp_path, caplog):
    """Two iterations of the trainer's own loop in this process: the teacher's weights stay those of its
    checkpoint, with no gradients and in no optimizer; the student's and the critic's weights move and their
    LR schedules count the same iterations. The start-up log holds the plan of the three networks."""
    from dfm.platform.distributed import destroy_distributed, initialize_distributed
    from dfm.training.data import build_mock_loader
    from dfm.training.distill_loop import CRITIC, build_distillation
    from dfm.training.distill_memory_plan import log_distill_plan
    from dfm.training.pretrain import RecordingIterator, RunContext, TrainLoop, finalize_defaults, resume_or_start

    teacher_dir, _, _ = runs
    device = initialize_distributed()
    try:
        cfg = build_config(None, str(TINY), [*distill_overrides(teacher_dir), f"logger.log_dir={tmp_path}"])
        layout = ParallelLayout(world_size=1)
        finalize_defaults(cfg, layout)
        state, players = build_distillation(cfg, layout, device, RecordingIterator(build_mock_loader(cfg, layout)))
        resume_or_start(cfg, state)
        with caplog.at_level("INFO", logger="dfm.train"):
            log_distill_plan(cfg, layout, state.model, device)
        assert "memory plan per rank (a DMD2 distillation)" in caplog.text, caplog.text
        assert "DMD2: student and critic each" in caplog.text and "teacher weights" in caplog.text, caplog.text
        teacher = players.forward_step.players.teacher
        critic = state.companions[CRITIC]
        before = {name: p.detach().clone() for name, p in teacher.named_parameters()}
        student_before = {name: p.detach().clone() for name, p in state.model[0].module.named_parameters()}
        critic_before = {name: p.detach().clone() for name, p in critic.model[0].module.named_parameters()}
        for start in (student_before, critic_before):  # both players start from the teacher
            assert all(torch.equal(start[name], before[name]) for name in before)
        loop = TrainLoop(RunContext(cfg, layout, device, True), state, players.forward_step, None, players)
        for iteration in (1, 2):
            loop.step(iteration)
        # both schedules count iterations: the critic stepped twice, the student once by critic_steps (2)
        assert state.scheduler.num_steps == critic.scheduler.num_steps == 2
        after = dict(teacher.named_parameters())
        assert all(torch.equal(before[name], after[name]) for name in before)
        assert all(not p.requires_grad and p.grad is None for p in teacher.parameters())
        optimized = {
            id(p) for opt in (state.optimizer, critic.optimizer) for g in opt.param_groups for p in g["params"]
        }
        assert not optimized & {id(p) for p in teacher.parameters()}
        for start, chunk in ((student_before, state.model[0]), (critic_before, critic.model[0])):
            assert any(not torch.equal(start[name], p) for name, p in chunk.module.named_parameters())
        loop.metrics.close()
    finally:
        destroy_distributed()


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["model.pipeline=edm", "checkpoint.pretrained=x"], "model.pipeline"),
        ([*FLOW], "checkpoint.pretrained"),
        (
            [*FLOW, "checkpoint.pretrained=x", "model.pipeline_model_parallel_size=2"],
            "model.pipeline_model_parallel_size",
        ),
    ],
)
def test_distillation_refuses_what_it_cannot_run_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=f"distill.enabled=true .*: {key}="):
        build_config(None, str(TINY), ["distill.enabled=true", *overrides], world_size=2)


@pytest.mark.parametrize("extra", [[], GAN])
def test_distillation_is_accepted_under_megatron_fsdp(extra):
    """Megatron-FSDP runs, with the GAN loss too (test_distill_layouts.py); it needs DP >= 2."""
    overrides = ["distill.enabled=true", *FLOW, "checkpoint.pretrained=x", "ddp.use_megatron_fsdp=true", *extra]
    assert build_config(None, str(TINY), overrides, world_size=2).ddp.use_megatron_fsdp


def test_distillation_is_off_by_default_and_its_settings_are_checked():
    assert not build_config(None, str(TINY)).distill.enabled
    with pytest.raises(ConfigError, match="distill.student_timesteps must start at 1.0"):
        build_config(None, str(TINY), ["distill.student_timesteps=[0.5]"])


def test_the_timestep_shift_maps_the_students_times_and_must_be_positive():
    """Training, inference and export read the times through ``settings()``: shifted there, once."""
    base = ["distill.enabled=true", *FLOW, "checkpoint.pretrained=x"]
    cfg = build_config(None, str(TINY), [*base, "distill.timestep_shift=3"], world_size=1)
    assert cfg.distill.settings().student_timesteps == [1.0, 0.9, 0.75, 0.5]  # 3t / (1 + 2t)
    assert cfg.distill.student_timesteps == [1.0, 0.75, 0.5, 0.25]  # the config keeps what was given
    with pytest.raises(ConfigError, match="distill.timestep_shift"):
        build_config(None, str(TINY), [*base, "distill.timestep_shift=0"], world_size=1)


def test_same_shape_samples_takes_the_most_common_shape():
    """Samples 0 and 2 share a shape (2 tokens each, one padding token in sample 2); sample 1 has its own."""
    ids = torch.tensor([0, 0, 1, 1, 1, 2, 2])
    mask = torch.tensor([1, 1, 1, 1, 1, 1, 0.0])
    tokens, packing = same_shape_samples(Packing(ids, mask, 3), [(4, 1, 2, 2), (4, 1, 2, 4), (4, 1, 2, 2)])
    assert tokens.tolist() == [0, 1, 5, 6]
    assert packing.sample_ids.tolist() == [0, 0, 1, 1] and packing.loss_mask.tolist() == [1, 1, 1, 0]
    assert packing.num_samples == 2
    assert same_shape_samples(Packing(ids, mask, 3), [(1,), (2,), (3,)]) is None
