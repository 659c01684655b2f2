"""Resume with changed run settings, through the real entry point (one process, the tiny model): data
settings are refused naming old and new, or with checkpoint.allow_setting_changes=true continue
from a fresh data position with a log line; a learning-rate change is logged and applies. The distill
settings' rules are checked on compare_run_settings alone (no process)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import webdataset as wds
from entry import read_metrics, run_entry

from dfm.checkpoint.errors import CheckpointError
from dfm.checkpoint.run_settings import compare_run_settings
from dfm.config.container import ConfigContainer
from dfm.config.loader import config_to_dict
from dfm.data.prepare.energon_prepare import run_energon_prepare


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A checkpoint of 2 iterations on mock data."""
    root = tmp_path_factory.mktemp("saved") / "ckpt"
    log_dir = root.parent / "logs"
    result = run_entry(1, ["train.train_iters=2", f"checkpoint.save={root}", f"logger.log_dir={log_dir}"])
    assert result.returncode == 0, result.stderr[-3000:]
    return root


def resume(tmp: Path, root: Path, *overrides: str, mock: bool = True):
    args = ["train.train_iters=3", f"checkpoint.load={root}", f"logger.log_dir={tmp / 'logs'}", *overrides]
    return run_entry(1, args, mock=mock)


@pytest.mark.slow
def test_changed_batch_sizes_and_packing_length_are_refused_naming_old_and_new(tmp_path, saved):
    result = resume(tmp_path, saved, "train.micro_batch_size=2", "train.global_batch_size=4", "dataset.seq_length=512")
    assert result.returncode != 0
    for change in (
        "train.micro_batch_size: checkpoint 1, this run 2",
        "train.global_batch_size: checkpoint 2, this run 4",
        "dataset.seq_length: checkpoint 256, this run 512",
    ):
        assert change in result.stderr, result.stderr[-3000:]
    assert "checkpoint.allow_setting_changes=true" in result.stderr
    assert not (tmp_path / "logs" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_energon_data_after_mock_is_refused(tmp_path, saved):
    gen = torch.Generator().manual_seed(0)
    with wds.ShardWriter(str(tmp_path / "part-%06d.tar"), maxcount=100, verbose=0) as writer:
        for i in range(8):
            latent, text = torch.randn(4, 1, 8, 8, generator=gen), torch.randn(6, 32, generator=gen)
            writer.write({"__key__": f"s{i}", "pth": latent, "pickle": text, "json": {}})
    run_energon_prepare(tmp_path)
    result = resume(tmp_path, saved, f"dataset.path={tmp_path}", "dataset.num_workers=0", mock=False)
    assert result.returncode != 0
    assert "data: checkpoint mock, this run energon" in result.stderr, result.stderr[-3000:]
    assert "loader state has format" not in result.stderr


@pytest.mark.slow
def test_with_allow_setting_changes_the_run_continues_and_logs(tmp_path, saved):
    result = resume(
        tmp_path,
        saved,
        "checkpoint.allow_setting_changes=true",
        "train.micro_batch_size=2",
        "train.global_batch_size=2",
        "optimizer.lr=0.0005",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "train.micro_batch_size: checkpoint 1, this run 2: the data position starts over" in result.stderr
    assert "optimizer.lr: checkpoint 0.001, this run 0.0005: the new value applies from here on" in result.stderr
    records = [r for r in read_metrics(tmp_path / "logs") if "loss" in r]
    assert [(r["iteration"], r["lr"]) for r in records] == [(3, 0.0005)]


def test_each_data_kind_compares_the_keys_that_define_its_samples(tmp_path):
    cfg = ConfigContainer()
    energon, mock = {"config": config_to_dict(cfg), "data_kind": "energon"}, {"config": config_to_dict(cfg)}
    assert compare_run_settings(energon, tmp_path, cfg, "energon").data_position
    cfg.dataset.path = "/other"
    with pytest.raises(CheckpointError, match="dataset.path: checkpoint None, this run '/other'"):
        compare_run_settings(energon, tmp_path, cfg, "energon")
    assert compare_run_settings(mock, tmp_path, cfg, "mock").data_position  # mock data ignores the path
    cfg.dataset.mock_image_fraction = 0.25
    with pytest.raises(CheckpointError, match="dataset.mock_image_fraction: checkpoint 0.5, this run 0.25"):
        compare_run_settings(mock, tmp_path, cfg, "mock")


def test_a_changed_energon_read_order_is_a_data_change(tmp_path):
    cfg = ConfigContainer()
    saved = config_to_dict(cfg)
    del saved["dataset"]["shuffle_buffer_size"], saved["dataset"]["max_samples_per_sequence"]
    common = {"config": saved, "data_kind": "energon"}  # a checkpoint from before they were settings: 100 and 100
    assert compare_run_settings(common, tmp_path, cfg, "energon").data_position
    cfg.dataset.shuffle_buffer_size, cfg.dataset.max_samples_per_sequence = 2000, None
    with pytest.raises(CheckpointError) as refused:
        compare_run_settings(common, tmp_path, cfg, "energon")
    for change in (
        "dataset.shuffle_buffer_size: checkpoint 100, this run 2000",
        "dataset.max_samples_per_sequence: checkpoint 100, this run None",
    ):
        assert change in str(refused.value)
    cfg.checkpoint.allow_setting_changes = True
    assert not compare_run_settings(common, tmp_path, cfg, "energon").data_position  # starts over, logged


def test_pipeline_and_precision_changes_are_named(tmp_path):
    cfg = ConfigContainer()
    common = {"config": config_to_dict(cfg)}
    cfg.model.pipeline = "flow"
    with pytest.raises(CheckpointError, match="model.pipeline: checkpoint 'edm', this run 'flow'"):
        compare_run_settings(common, tmp_path, cfg, "mock")
    cfg.checkpoint.allow_setting_changes = True
    assert compare_run_settings(common, tmp_path, cfg, "mock").data_position  # applied, logged
    cfg.model.pipeline = "edm"
    cfg.mixed_precision.precision = "bf16"
    with pytest.raises(
        CheckpointError, match="mixed_precision.precision: checkpoint 'fp32', this run 'bf16'.*pretrained"
    ):
        compare_run_settings(common, tmp_path, cfg, "mock")


def energon_folder(path: Path, uuid: str) -> Path:
    (path / ".nv-meta").mkdir(parents=True)
    (path / ".nv-meta" / "index.uuid").write_text(uuid)
    return path


def test_a_dataset_is_compared_by_its_identity_not_its_spelling(tmp_path, monkeypatch):
    from dfm.checkpoint.run_settings import DATASET_ID, dataset_identity

    folder = energon_folder(tmp_path / "data", "1111")
    (tmp_path / "link").symlink_to(folder)
    cfg = ConfigContainer()
    cfg.dataset.path = str(folder)
    common = {"config": config_to_dict(cfg), "data_kind": "energon", DATASET_ID: dataset_identity(str(folder))}
    monkeypatch.chdir(tmp_path)
    for spelling in (f"{folder}/", str(tmp_path / "link"), "data", "./data/"):
        cfg.dataset.path = spelling
        assert compare_run_settings(common, tmp_path, cfg, "energon").data_position, spelling
    # the same string, another dataset (re-prepared, or another folder now at that path)
    (folder / ".nv-meta" / "index.uuid").write_text("2222")
    cfg.dataset.path = str(folder)
    with pytest.raises(CheckpointError, match=r"dataset.path: checkpoint .* \(energon index 1111\), this run .*2222"):
        compare_run_settings(common, tmp_path, cfg, "energon")
    # checkpoints without a recorded identity: compared by the resolved path
    del common[DATASET_ID]
    cfg.dataset.path = str(tmp_path / "link")
    assert compare_run_settings(common, tmp_path, cfg, "energon").data_position


def distilling() -> ConfigContainer:
    cfg = ConfigContainer()
    cfg.distill.enabled = True
    return cfg


def test_switching_distillation_on_or_off_is_refused_either_way(tmp_path):
    plain, distilled = ConfigContainer(), distilling()
    for saved, now, held in ((distilled, plain, "holds a critic"), (plain, distilled, "holds no critic")):
        now.checkpoint.allow_setting_changes = True  # no way round: the critic is there or it is not
        change = f"distill.enabled: checkpoint {saved.distill.enabled}, this run {now.distill.enabled}"
        with pytest.raises(CheckpointError, match=re.escape(change) + ".*checkpoint.pretrained=") as refused:
            compare_run_settings({"config": config_to_dict(saved)}, tmp_path, now, "mock")
        assert held in str(refused.value)
    before = config_to_dict(plain)
    del before["distill"]  # a checkpoint from before the distill section: plain
    assert compare_run_settings({"config": before}, tmp_path, plain, "mock").data_position
    with pytest.raises(CheckpointError, match="holds no critic"):
        compare_run_settings({"config": before}, tmp_path, distilled, "mock")


@pytest.mark.parametrize(
    "key, value", [("student_timesteps", [1.0, 0.5]), ("guidance_scale", 4.5), ("regression_weight", 0.25)]
)
def test_a_changed_distillation_target_is_refused_naming_the_key(tmp_path, caplog, key, value):
    cfg = distilling()
    common = {"config": config_to_dict(cfg)}
    change = f"distill.{key}: checkpoint {getattr(cfg.distill, key)!r}, this run {value!r}"
    setattr(cfg.distill, key, value)
    with pytest.raises(CheckpointError, match=re.escape(change) + ".*allow_setting_changes=true"):
        compare_run_settings(common, tmp_path, cfg, "mock")
    cfg.checkpoint.allow_setting_changes = True
    with caplog.at_level("WARNING", logger="dfm.checkpoint"):
        resume = compare_run_settings(common, tmp_path, cfg, "mock")
    assert resume.data_position and resume.new_lr is None
    assert f"{change}: the new value applies from here on" in caplog.text


def gan_on() -> ConfigContainer:
    cfg = distilling()
    cfg.distill.gan_critic_weight, cfg.distill.gan_student_weight = 0.3, 0.1
    return cfg


def test_switching_the_gan_loss_on_or_off_is_refused_either_way(tmp_path):
    """The critic's classifier is in the checkpoint or it is not: no allow_setting_changes gets round that.
    A checkpoint from before the GAN keys had it off."""
    for saved, now, held in ((gan_on(), distilling(), "holds a GAN classifier"), (distilling(), gan_on(), "holds no")):
        now.checkpoint.allow_setting_changes = True
        with pytest.raises(CheckpointError, match=f"{held}.*distill.gan_critic_weight: checkpoint"):
            compare_run_settings({"config": config_to_dict(saved)}, tmp_path, now, "mock")
    before_the_keys = config_to_dict(distilling())
    for key in ("gan_critic_weight", "gan_student_weight"):
        del before_the_keys["distill"][key]
    assert compare_run_settings({"config": before_the_keys}, tmp_path, distilling(), "mock").data_position
    with pytest.raises(CheckpointError, match="holds no GAN classifier"):
        compare_run_settings({"config": before_the_keys}, tmp_path, gan_on(), "mock")
    weaker = gan_on()  # the classifier stays: another weight is another target, refused like the others
    weaker.distill.gan_student_weight = 0.05
    with pytest.raises(CheckpointError, match=re.escape("distill.gan_student_weight: checkpoint 0.1, this run 0.05")):
        compare_run_settings({"config": config_to_dict(gan_on())}, tmp_path, weaker, "mock")


def test_the_regression_teachers_steps_count_only_where_the_regression_is_on(tmp_path):
    """Its targets change with the teacher's step count: refused like the other targets while the
    regression is on; ignored while it is off, and absent from checkpoints made before the key."""
    cfg = distilling()
    cfg.distill.regression_weight = 0.5
    common = {"config": config_to_dict(cfg)}
    cfg.distill.regression_teacher_steps = 20
    with pytest.raises(
        CheckpointError, match=re.escape("distill.regression_teacher_steps: checkpoint 12, this run 20")
    ):
        compare_run_settings(common, tmp_path, cfg, "mock")
    off = distilling()
    before_the_key = config_to_dict(off)
    del before_the_key["distill"]["regression_teacher_steps"]
    off.distill.regression_teacher_steps = 20
    for saved in (config_to_dict(distilling()), before_the_key):
        assert compare_run_settings({"config": saved}, tmp_path, off, "mock").data_position


WAN_SHIFTED = [1.0, 0.9375, 0.8333333333333334, 0.625]  # [1, 0.75, 0.5, 0.25] at shift 5


def test_the_students_timesteps_compare_as_trained_at_after_the_shift(tmp_path):
    """distill.timestep_shift maps the given times: the same times spelled out resume; the unshifted ones (a
    checkpoint from before the key) are another student, refused naming both."""
    shifted, spelled = distilling(), distilling()
    shifted.distill.timestep_shift = 5.0
    spelled.distill.student_timesteps = list(WAN_SHIFTED)
    assert shifted.distill.settings().student_timesteps == WAN_SHIFTED
    assert compare_run_settings({"config": config_to_dict(shifted)}, tmp_path, spelled, "mock").data_position
    before_the_key = config_to_dict(distilling())
    del before_the_key["distill"]["timestep_shift"]
    change = f"distill.student_timesteps: checkpoint [1.0, 0.75, 0.5, 0.25], this run {WAN_SHIFTED}"
    with pytest.raises(CheckpointError, match=re.escape(change)):
        compare_run_settings({"config": before_the_key}, tmp_path, shifted, "mock")


@pytest.mark.parametrize("key, value", [("min_t", 0.1), ("max_t", 0.9), ("critic_steps", 2)])
def test_a_changed_distillation_schedule_is_logged_and_applied(tmp_path, caplog, key, value):
    cfg = distilling()
    common = {"config": config_to_dict(cfg)}
    change = f"distill.{key}: checkpoint {getattr(cfg.distill, key)!r}, this run {value!r}"
    setattr(cfg.distill, key, value)
    with caplog.at_level("WARNING", logger="dfm.checkpoint"):
        resume = compare_run_settings(common, tmp_path, cfg, "mock")
    assert resume.data_position and resume.new_lr is None  # the data position and the lrs are kept
    assert f"{change}: the new value applies from here on" in caplog.text
    assert getattr(cfg.distill.settings(), key) == value  # the run's steps are built from this config


def test_a_plain_run_ignores_its_unused_distill_settings(tmp_path, caplog):
    cfg = ConfigContainer()
    common = {"config": config_to_dict(cfg)}
    cfg.distill.guidance_scale, cfg.distill.min_t = 4.5, 0.1
    with caplog.at_level("WARNING", logger="dfm.checkpoint"):
        assert compare_run_settings(common, tmp_path, cfg, "mock").data_position
    assert "distill" not in caplog.text
