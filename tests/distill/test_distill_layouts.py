"""DMD2 distillation at each layout it runs equals one process (docs/distillation.md): the tiny flow teacher
of test_distill_run.py distilled for 4 iterations (the student steps at 2 and 4, the critic at every one) at
TP=2 with sequence parallelism, CP=2 and DP=2 with the distributed optimizer; both players' losses and
gradient norms against the one-process run's. And a one-process checkpoint of both players resumes at TP=2
to the one-process losses. (PP and Megatron-FSDP are refused at start-up: test_distill_run.py.)"""

from __future__ import annotations

import math

import pytest

from tests.distill.test_distill_run import FLOW, distill_overrides
from tests.parallel.equivalence import DIST_OPT
from tests.training.entry import read_metrics, run_in_one_launch

LAYOUTS = {
    "tp2_sp": ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"],
    "cp2": ["model.context_parallel_size=2"],
    "dp2_distopt": [DIST_OPT],  # the tiny config's global batch of 2: one micro-batch a rank
}
KEYS = ("critic_loss", "critic_grad_norm", "student_loss", "student_grad_norm")
# Losses come out equal; the gradient norms' sums run in another order across ranks (measured: <= 1.4e-7 relative).
REL = 1e-6


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[int, dict]]:
    tmp = tmp_path_factory.mktemp("distill_layouts")
    teacher, save = tmp / "teacher", tmp / "one_ckpt"
    teach = [*FLOW, "train.train_iters=2", f"checkpoint.save={teacher}", f"logger.log_dir={tmp / 'teacher_logs'}"]
    one = [*distill_overrides(teacher), f"checkpoint.save={save}", "checkpoint.save_interval=2"]
    run_in_one_launch(1, [teach, [*one, f"logger.log_dir={tmp / 'one'}"]], tmp / "launch1")
    layouts = [[*distill_overrides(teacher), *extra, f"logger.log_dir={tmp / name}"] for name, extra in LAYOUTS.items()]
    resumed = [
        *distill_overrides(teacher),
        *LAYOUTS["tp2_sp"],
        f"checkpoint.load={save}/iter_0000002",
        f"logger.log_dir={tmp / 'resumed_tp2_sp'}",
    ]
    run_in_one_launch(2, [*layouts, resumed], tmp / "launch2")
    names = ("one", *LAYOUTS, "resumed_tp2_sp")
    return {name: {r["iteration"]: r for r in read_metrics(tmp / name)} for name in names}


def assert_close(run: dict[int, dict], reference: dict[int, dict], case: str, keys=KEYS) -> None:
    for iteration, record in run.items():
        for key in keys(iteration) if callable(keys) else keys:
            got, want = record[key], reference[iteration][key]
            if want is None:
                assert got is None, (case, iteration, key, got)
            else:
                assert math.isclose(got, want, rel_tol=REL, abs_tol=0.0), (case, iteration, key, got, want)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_distils_like_one_process(runs, layout):
    assert sorted(runs[layout]) == [1, 2, 3, 4]
    assert runs["one"][4]["student_loss"] is not None
    assert_close(runs[layout], runs["one"], layout)


@pytest.mark.slow
def test_one_process_checkpoint_resumes_at_tp2(runs):
    assert sorted(runs["resumed_tp2_sp"]) == [3, 4]
    # At 3 the resumed student has not stepped yet (its line carries none); it steps at 4 from the resumed players.
    assert_close(runs["resumed_tp2_sp"], runs["one"], "resumed_tp2_sp", lambda i: KEYS if i == 4 else KEYS[:2])
