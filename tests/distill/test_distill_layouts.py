"""DMD2 distillation at each layout it runs equals one process (docs/distillation.md): the tiny flow teacher
of test_distill_run.py distilled for 4 iterations (the student steps at 2 and 4, the critic at every one) at
TP=2 with sequence parallelism, CP=2, DP=2 with the distributed optimizer and DP=2 under Megatron-FSDP; both
players' losses and gradient norms against the one-process run's. And checkpoints of both players resume: the
one-process run's at TP=2, the FSDP run's under FSDP, to the one-process losses. (PP is refused at start-up:
test_distill_run.py.)"""

from __future__ import annotations

import math

import pytest

from tests.distill.test_distill_run import FLOW, distill_overrides
from tests.parallel.equivalence import DIST_OPT, FSDP
from tests.training.entry import read_metrics, run_in_one_launch

LAYOUTS = {
    "tp2_sp": ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"],
    "cp2": ["model.context_parallel_size=2"],
    "dp2_distopt": [DIST_OPT],  # the tiny config's global batch of 2: one micro-batch a rank
    "dp2_fsdp": FSDP,  # parameters, gradients and optimizer state sharded over the 2 ranks
}
# Each resume: the layout it runs at and the checkpoint it starts from (iteration 2).
RESUMES = {"resumed_tp2_sp": ("tp2_sp", "one_ckpt"), "resumed_dp2_fsdp": ("dp2_fsdp", "fsdp_ckpt")}
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
    layouts[list(LAYOUTS).index("dp2_fsdp")] += [f"checkpoint.save={tmp / 'fsdp_ckpt'}", "checkpoint.save_interval=2"]
    resumed = [
        [
            *distill_overrides(teacher),
            *LAYOUTS[layout],
            f"checkpoint.load={tmp / ckpt}/iter_0000002",
            f"logger.log_dir={tmp / name}",
        ]
        for name, (layout, ckpt) in RESUMES.items()
    ]
    run_in_one_launch(2, [*layouts, *resumed], tmp / "launch2")  # the FSDP resume after the run that saves it
    names = ("one", *LAYOUTS, *RESUMES)
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
@pytest.mark.parametrize("resumed", list(RESUMES))
def test_checkpoint_of_both_players_resumes(runs, resumed):
    assert sorted(runs[resumed]) == [3, 4]
    # At 3 the resumed student has not stepped yet (its line carries none); it steps at 4 from the resumed players.
    assert_close(runs[resumed], runs["one"], resumed, lambda i: KEYS if i == 4 else KEYS[:2])
