"""Checkpoints through the real entry point: exact resume, resharding, non-finite steps (checkpoint
faults: tests/faults)."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest
from entry import FAULT_ENTRY, read_metrics, run_entry, run_in_one_launch

DP2 = ["ddp.use_distributed_optimizer=true", "dataset.mock_samples_per_pack=2"]
TP2_PP2 = ["model.tensor_model_parallel_size=2", "model.pipeline_model_parallel_size=2"]


def train(tmp: Path, name: str, nproc: int, overrides: list[str], **kwargs) -> tuple[subprocess.CompletedProcess, Path]:
    log_dir = tmp / name
    result = run_entry(nproc, [*overrides, f"logger.log_dir={log_dir}"], **kwargs)
    return result, log_dir


def losses(log_dir: Path) -> dict[int, float]:
    return {r["iteration"]: r["loss"] for r in read_metrics(log_dir)}


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stderr[-4000:]


def straight_and_resumed(tmp: Path, nproc: int, layout: list[str]) -> tuple[dict, dict]:
    """10 iterations straight (saving at 5), then 5 more resumed from the iteration-5 checkpoint."""
    save, straight, resumed = tmp / "ckpt", tmp / "straight", tmp / "resumed"
    first = [f"logger.log_dir={straight}", f"checkpoint.save={save}", "checkpoint.save_interval=5"]
    then = [f"logger.log_dir={resumed}", f"checkpoint.load={save}/iter_0000005"]
    iters = "train.train_iters=10"
    run_in_one_launch(nproc, [[*layout, iters, *first], [*layout, iters, *then]], tmp / "launch")
    return losses(straight), losses(resumed)


@pytest.fixture(scope="module")
def dp2_runs(tmp_path_factory):
    return straight_and_resumed(tmp_path_factory.mktemp("dp2"), 2, DP2)


@pytest.mark.slow
def test_exact_resume_dp2(dp2_runs):
    straight, resumed = dp2_runs
    assert sorted(resumed) == [6, 7, 8, 9, 10]
    assert all(resumed[i] == straight[i] for i in resumed), (straight, resumed)  # bitwise on CPU


@pytest.mark.slow
def test_exact_resume_tp2_pp2(tmp_path):
    straight, resumed = straight_and_resumed(tmp_path, 4, TP2_PP2)
    assert sorted(resumed) == [6, 7, 8, 9, 10]
    assert all(resumed[i] == straight[i] for i in resumed), (straight, resumed)


@pytest.mark.slow
def test_tp2_checkpoint_loads_into_tp1_pp2(tmp_path):
    save, tp2, pp2 = tmp_path / "ckpt", tmp_path / "tp2", tmp_path / "pp2"
    first = ["model.tensor_model_parallel_size=2", f"checkpoint.save={save}", "checkpoint.save_interval=2"]
    then = ["model.pipeline_model_parallel_size=2", f"checkpoint.load={save}/iter_0000002"]
    runs = [[*first, f"logger.log_dir={tp2}"], [*then, f"logger.log_dir={pp2}"]]
    run_in_one_launch(2, [[*run, "train.train_iters=3"] for run in runs], tmp_path / "launch")
    assert losses(pp2)[3] == pytest.approx(losses(tp2)[3], rel=1e-5)


@pytest.mark.slow
def test_nonfinite_loss_skips_the_update(tmp_path):
    env = {"DFM_TEST_FAULT": "nonfinite_loss:3"}
    result, log_dir = train(tmp_path, "nan", 1, ["train.train_iters=5"], entry=FAULT_ENTRY, env=env)
    assert_ok(result)
    records = {r["iteration"]: r for r in read_metrics(log_dir)}
    assert math.isnan(records[3]["loss"]) and records[3]["grad_norm"] is None
    assert records[5]["skipped_iterations"] == 1
    assert math.isfinite(records[4]["loss"]) and math.isfinite(records[5]["loss"])


@pytest.mark.slow
def test_consecutive_nonfinite_steps_stop_the_run(tmp_path):
    env = {"DFM_TEST_FAULT": "nonfinite_loss:2,3"}
    result, _ = train(
        tmp_path, "nan", 1, ["train.train_iters=5", "train.max_consecutive_nonfinite=2"], entry=FAULT_ENTRY, env=env
    )
    assert result.returncode != 0
    assert "2 consecutive iterations with a non-finite loss" in result.stderr
