"""DMD2 students of a digits flow teacher, measured (docs/distillation.md, "Measured on the digits").

    cd examples/megatron/recipes/dit
    python -m digits.distill --out_dir outputs/digits_distill [--iterations 600 --save_interval 100 ...] \
        [--grid samples.png]
    python -m digits.distill --clips 500 --out_dir outputs/digits_distill_clips --students 4-step ...
    python -m digits.distill --students 1-step --regression_weight 1 ...   # with DMD's regression loss
    python -m digits.distill --students 1-step --gan_critic_weight 0.3 --gan_student_weight 0.1 ...  # DMD2's GAN

The teacher is trained as the CI test trains its flow model (conf/digits_tiny.yaml, or reused when
OUT_DIR/teacher already holds it) and scored at 12 Euler steps with guidance 3: its accuracy is A.
Each student is distilled from it through the ordinary entry point (``distill.enabled=true``,
``checkpoint.pretrained=<teacher>``), saved every ``save_interval`` iterations, and every save is scored
unguided at the student's own timesteps (digits.evaluate samples a student as inference_dit_model.py
does). The curve starts at the student before its first update (a one-iteration run: the student's first
update is at iteration ``critic_steps``), i.e. the teacher's weights sampled the student's way, unguided.
-> OUT_DIR/distill.json: A, each student's curve (accuracy, accuracy / A, diversity against the
real digits', near copies) and the settings; ``--grid``: the teacher's samples and each student's at its
start and its end, a row per digit. ``--clips N``: the same on N moving-digit clips (conf/digits_video_tiny.yaml,
the teacher as tests/learning/test_video_learn.py trains it), where the scores add motion accuracy.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from digits.clips import ClipSpec
from digits.evaluate import DigitSampling
from digits.plot import plot_sample_grid
from digits.run import CI_CONFIG, CLIP_CONFIG, prepare_digits, score_digits, train_digits

TEACHER_SAMPLING = DigitSampling(samples_per_caption=20, steps=12, guidance_scale=3.0, seed=0)
STUDENTS = {"4-step": [1.0, 0.75, 0.5, 0.25], "1-step": [1.0]}
SCORE_KEYS = (
    "conditional_accuracy",
    "unconditional_accuracy",
    "diversity_ratio",
    "near_copy_fraction",
    "nearest_ratio",
    "motion_accuracy",
    "temporal_consistency",
)


@dataclass(frozen=True)
class DistillRun:
    """What each student's distillation is set to (the rest is ``config``'s)."""

    iterations: int = 600
    save_interval: int = 100
    lr: float = 5e-4  # student and critic alike (one optimizer section)
    lr_decay_style: str = "constant"  # both players' schedules, over the run's iterations
    critic_steps: int = 5
    guidance_scale: float = 3.0  # the teacher's, baked into the student
    # DMD's regression onto the teacher's guided Euler samples from the student's noise (0: off)
    regression_weight: float = 0.0
    regression_teacher_steps: int = 12  # TEACHER_SAMPLING's steps
    # DMD2's GAN loss: the critic's classifier loss and the student's generator loss (0 and 0: off)
    gan_critic_weight: float = 0.0
    gan_student_weight: float = 0.0
    config: str = str(CI_CONFIG)  # the teacher's and the students' (clips: CLIP_CONFIG)
    seed: int = 1234  # the students' runs (rng.seed: their noise, times and data order); the teacher keeps its own

    def overrides(self, teacher: Path, timesteps: Sequence[float]) -> list[str]:
        times = ",".join(str(t) for t in timesteps)
        return [
            "model.pipeline=flow",
            "distill.enabled=true",
            f"checkpoint.pretrained={Path(teacher).resolve()}",
            f"distill.student_timesteps=[{times}]",
            f"distill.guidance_scale={self.guidance_scale}",
            f"distill.critic_steps={self.critic_steps}",
            f"distill.regression_weight={self.regression_weight}",
            f"distill.regression_teacher_steps={self.regression_teacher_steps}",
            f"distill.gan_critic_weight={self.gan_critic_weight}",
            f"distill.gan_student_weight={self.gan_student_weight}",
            f"optimizer.lr={self.lr}",
            f"scheduler.lr_decay_style={self.lr_decay_style}",
            f"train.train_iters={self.iterations}",
            f"checkpoint.save_interval={self.save_interval}",
            f"rng.seed={self.seed}",
        ]


def trained_teacher(root: Path, overrides: Sequence[str] = (), config: Path = CI_CONFIG) -> Path:
    """The flow teacher's checkpoint root under ``root/teacher``: trained as the CI test trains it, or reused."""
    checkpoint = root / "teacher" / "ckpt"
    if (checkpoint / "latest_checkpointed_iteration.txt").is_file() or list(checkpoint.glob("iter_*")):
        return checkpoint
    return train_digits(root / "dataset", root / "teacher", Path(config), ["model.pipeline=flow", *overrides])


def figures(score: dict, teacher_accuracy: float | None = None, critic_steps: int | None = None) -> dict:
    """The scores a curve keeps (no samples), with the accuracy relative to the teacher's and the number of
    student updates up to the checkpoint (the student steps every ``critic_steps``-th iteration)."""
    kept = {"iteration": score["iteration"], **{key: score.get(key) for key in SCORE_KEYS}}
    if critic_steps:
        kept["student_updates"] = score["iteration"] // critic_steps
    if teacher_accuracy:
        kept["relative_accuracy"] = score["conditional_accuracy"] / teacher_accuracy
    return kept


def distil_and_score(
    root: Path,
    teacher: Path,
    name: str,
    timesteps: Sequence[float],
    run: DistillRun,
    samples: int,
    with_start: bool = True,
) -> list[dict]:
    """Distil the student ``name`` into ``root/name`` and score each of its saves, after the student as it
    starts (``root/name-start``; unless not ``with_start``) -> their scores."""
    saves = [starting_student(root, teacher, name, timesteps, run)] if with_start else []
    checkpoints = train_digits(root / "dataset", root / name, Path(run.config), run.overrides(teacher, timesteps))
    sampling = DigitSampling(samples_per_caption=samples, seed=TEACHER_SAMPLING.seed)
    saves += sorted(checkpoints.glob("iter_*"))
    return score_digits(saves, root, sampling, root / name / "scores.json")


def starting_student(root: Path, teacher: Path, name: str, timesteps: Sequence[float], run: DistillRun) -> Path:
    """A one-iteration distillation saved (``root/name-start``): the critic steps once, the student not at all,
    so this student checkpoint holds the teacher's weights -> its iter_0000001."""
    if run.critic_steps < 2:
        raise ValueError("the curve's start needs critic_steps >= 2 (no student update in iteration 1)")
    # No warm-up: the config refuses one longer than the run (and the student takes no step anyway).
    overrides = [
        *replace(run, iterations=1, save_interval=1).overrides(teacher, timesteps),
        "scheduler.lr_warmup_iters=0",
    ]
    return train_digits(root / "dataset", root / f"{name}-start", Path(run.config), overrides) / "iter_0000001"


def measure(
    root: Path,
    run: DistillRun,
    students: dict[str, list[float]],
    samples: int,
    teacher_overrides: Sequence[str] = (),
    clips: int | None = None,
) -> dict:
    """Teacher, A, then each student's curve -> the summary (also written to ``root/distill.json``).
    ``clips``: prepare that many moving-digit clips (``run.config`` should be CLIP_CONFIG) instead of the digits."""
    start = time.perf_counter()
    prepare_digits(root, clips=ClipSpec() if clips else None, limit=clips)
    teacher = trained_teacher(root, teacher_overrides, Path(run.config))
    sampling = DigitSampling(
        samples, TEACHER_SAMPLING.steps, TEACHER_SAMPLING.guidance_scale, seed=TEACHER_SAMPLING.seed
    )
    teacher_score = score_digits([teacher], root, sampling, root / "teacher" / "scores.json")[0]
    accuracy = teacher_score["conditional_accuracy"]
    print(f"teacher (12 steps, guidance 3): {figures(teacher_score)}", flush=True)
    summary = {
        "teacher": figures(teacher_score),
        "teacher_accuracy": accuracy,
        "settings": asdict(run),
        "samples_per_digit": samples,
        "students": {},
    }
    for name, timesteps in students.items():
        scores = distil_and_score(root, teacher, name, timesteps, run, samples)
        curve = [figures(s, accuracy, run.critic_steps) for s in scores]
        summary["students"][name] = {"student_timesteps": timesteps, "curve": curve}
        for point in curve:
            print(f"{name} {point}", flush=True)
    summary["minutes"] = round((time.perf_counter() - start) / 60, 1)
    (root / "distill.json").write_text(json.dumps(summary, indent=1))
    return summary


def plot_samples(root: Path, students: Sequence[str], samples: int, path: Path) -> Path:
    """The teacher's conditional samples and each student's first and last scored ones, side by side."""
    read = lambda scores: json.loads(scores.read_text())  # noqa: E731
    panels = {"teacher, 12 steps, CFG 3": read(root / "teacher" / "scores.json")[-1]["samples"]}
    for name in students:
        curve = read(root / name / "scores.json")
        panels[f"{name} start"] = curve[0]["samples"]
        panels[f"{name}, iter {curve[-1]['iteration']}"] = curve[-1]["samples"]
    return plot_sample_grid(panels, samples, path)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", default="outputs/digits_distill")
    p.add_argument("--students", nargs="+", default=list(STUDENTS), choices=list(STUDENTS))
    p.add_argument("--samples_per_caption", type=int, default=TEACHER_SAMPLING.samples_per_caption)
    p.add_argument("--grid", default=None, help="write a sample-grid PNG here (images only)")
    p.add_argument("--clips", type=int, default=None, help="distil on this many moving-digit clips instead")
    defaults = DistillRun()
    for field, value in asdict(defaults).items():
        p.add_argument(f"--{field}", type=type(value), default=value)
    p.add_argument("teacher_overrides", nargs="*", help="the teacher's training overrides, key=value")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run = DistillRun(**{field: getattr(args, field) for field in asdict(DistillRun())})
    if args.clips:
        run = replace(run, config=str(CLIP_CONFIG))
    students = {name: STUDENTS[name] for name in args.students}
    root = Path(args.out_dir).resolve()
    measure(root, run, students, args.samples_per_caption, args.teacher_overrides, args.clips)
    if args.grid:
        print(f"wrote {plot_samples(root, list(students), args.samples_per_caption, Path(args.grid))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
