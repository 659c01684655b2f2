"""Validation loss per noise level through the real entry point: every sample of the held-out packs
at each of ``train.eval_noise_bins`` fixed levels, the noise of iteration 0.

With lr 0 the weights never move, so the evaluations at iterations 1 and 2 must be bitwise equal
(random levels or noise drawn per evaluation would break it); DP=2 (one pack per rank) gives the
one-process values over the same two packs; TensorBoard holds ``validation/loss_t<k>``.
"""

from __future__ import annotations

import json
import math

import pytest
from entry import run_entry
from test_experiment_loggers import tensorboard_scalars

from dfm.diffusion.edm import EDMPipeline, EDMSettings
from dfm.diffusion.flow import FlowPipeline, FlowSettings

BINS = 4


def validation_records(tmp_path, nproc: int, packs_per_rank: int) -> list[dict]:
    log_dir = tmp_path / f"logs{nproc}"
    overrides = [
        "train.train_iters=2",
        "train.eval_interval=1",
        f"train.eval_iters={packs_per_rank}",
        f"train.eval_noise_bins={BINS}",
        "optimizer.lr=0",
        f"logger.log_dir={log_dir}",
        f"logger.tensorboard_dir={log_dir / 'tb'}",
    ]
    result = run_entry(nproc, overrides)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(line) for line in (log_dir / "validation.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("validation_levels")
    return {1: validation_records(tmp, 1, 2), 2: validation_records(tmp, 2, 1), "tb": tmp / "logs1" / "tb"}


def per_level(record: dict) -> list[float]:
    return [record[f"val_loss_t{k}"] for k in range(BINS)]


@pytest.mark.slow
def test_two_evaluations_of_the_same_weights_are_bitwise_equal(runs):
    first, second = runs[1]
    assert (first["iteration"], second["iteration"]) == (1, 2)
    assert per_level(first) == per_level(second) and first["val_loss"] == second["val_loss"]
    assert first["val_loss"] == pytest.approx(sum(per_level(first)) / BINS, rel=1e-12)
    assert len(set(per_level(first))) == BINS and all(math.isfinite(v) for v in per_level(first))
    assert first["val_levels"] == sorted(first["val_levels"])  # low noise to high


@pytest.mark.slow
def test_dp2_gives_the_one_process_values(runs):
    for one, two in zip(runs[1], runs[2]):
        assert per_level(two) == pytest.approx(per_level(one), rel=1e-6)


@pytest.mark.slow
def test_tensorboard_holds_each_level(runs):
    for k, expected in enumerate(per_level(runs[1][0])):
        assert tensorboard_scalars(runs["tb"], f"validation/loss_t{k}")[1] == pytest.approx(expected, rel=1e-6)
    assert tensorboard_scalars(runs["tb"], "validation/loss")[2] == pytest.approx(runs[1][1]["val_loss"], rel=1e-6)


def test_levels_are_the_bins_of_each_pipeline():
    # EDM: the training log-normal's quantiles at the bin centres (the middle bin of 3 at exp(P_mean)).
    edm = EDMPipeline(EDMSettings(P_mean=-1.2, P_std=1.2)).validation_levels(3)
    assert edm[1] == pytest.approx(math.exp(-1.2)) and edm[0] < edm[1] < edm[2]
    assert math.log(edm[2]) - math.log(edm[1]) == pytest.approx(1.2 * 0.967421566, rel=1e-6)  # Phi^-1(5/6)
    # Flow: bin centres of [t_min, t_max].
    assert FlowPipeline(FlowSettings()).validation_levels(4) == [0.125, 0.375, 0.625, 0.875]
    assert FlowPipeline(FlowSettings(t_min=0.5, t_max=1.0)).validation_levels(2) == [0.625, 0.875]
