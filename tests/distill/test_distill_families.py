"""DMD2 distillation of every model family through the real entry point (one process, ``--mock``): the tiny
configs of Wan 2.1, ST-DiT, FLUX.1 (pooled text, embedded guidance) and HunyuanVideo 1.5 (a second text and
image conditions) each train a flow teacher for 2 iterations, then distil it for 4 (the DiT family and MovieGen:
test_distill_run.py, test_distill_layouts.py). Both players train and log finite figures at every iteration."""

from __future__ import annotations

import math

import pytest

from tests.distill.test_distill_run import FLOW, distill_overrides
from tests.training.entry import RECIPE_DIR, read_metrics, run_in_one_launch

FAMILIES = {
    "wan": RECIPE_DIR / "conf" / "wan_tiny.yaml",
    "stdit": RECIPE_DIR / "conf" / "stdit_tiny.yaml",
    "flux": RECIPE_DIR.parent / "flux" / "conf" / "flux_tiny.yaml",
    "hunyuan": RECIPE_DIR.parent / "hunyuan" / "conf" / "hunyuan_tiny.yaml",
}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_distils_through_the_entry_point(family, tmp_path):
    teacher = tmp_path / "teacher"
    teach = [*FLOW, "train.train_iters=2", f"checkpoint.save={teacher}", f"logger.log_dir={tmp_path / 'tlogs'}"]
    distil = [*distill_overrides(teacher), f"logger.log_dir={tmp_path / 'logs'}"]
    run_in_one_launch(1, [teach, distil], tmp_path / "launch", config=FAMILIES[family])
    records = {r["iteration"]: r for r in read_metrics(tmp_path / "logs")}
    assert sorted(records) == [1, 2, 3, 4]
    for iteration, record in records.items():
        assert math.isfinite(record["critic_loss"]) and math.isfinite(record["critic_grad_norm"]), record
        assert record["student_iteration"] == (None if iteration == 1 else 2 * (iteration // 2)), record
    assert math.isfinite(records[4]["student_loss"]) and records[4]["student_grad_norm"] > 0
    assert records[4]["teacher_diversity"] is None or records[4]["teacher_diversity"] > 0
