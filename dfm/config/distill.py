"""The ``distill`` config section: DMD2 distillation of the ``checkpoint.pretrained`` flow model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dfm.diffusion.samplers import shift_timesteps
from dfm.distill.settings import DistillSettings


@dataclass
class DistillConfig(DistillSettings):
    """``enabled``: the run distils the ``checkpoint.pretrained`` model (the teacher, frozen) into a student and
    trains the critic beside it, both started from the teacher (docs/distillation.md); the other keys are
    ``DistillSettings``' (``distill.student_timesteps``, ``distill.critic_steps``, ...) and
    ``regression_teacher_steps``: the Euler steps of the teacher's guided ODE sample that a positive
    ``distill.regression_weight`` regresses the student's sample onto (dfm/training/distill_step.py)."""

    enabled: bool = False
    regression_teacher_steps: int = 12  # the digits teacher's scored sampling: 12 Euler steps
    # ``student_timesteps`` as given, then shifted t -> s t / (1 + (s - 1) t) (flow.shift's map): Wan's
    # [1, 0.75, 0.5, 0.25] at its sampling shift 5 are [1, 0.9375, 0.833, 0.625]. 1: used as given.
    timestep_shift: float = 1.0
    # A warning on the console when the student's diversity (``collapse_diversity``, its samples' pairwise
    # distance over the data's) falls below this fraction of the teacher's (its guided ODE samples of the run's
    # first packs, measured once at the run's first iteration). 0: off, and the teacher is not sampled.
    collapse_warning: float = 0.5

    def settings(self) -> DistillSettings:
        """The DMD2 settings as the config holds them now, checked (ValueError names the key); the student's
        timesteps shifted by ``timestep_shift``."""
        values = {item.name: getattr(self, item.name) for item in dataclasses.fields(DistillSettings)}
        values["student_timesteps"] = shifted_times(self.student_timesteps, self.timestep_shift)
        return DistillSettings(**values)


def shifted_times(times: list[float], shift: float) -> list[float]:
    """The student's timesteps ``times`` under the flow shift ``shift`` (1: themselves)."""
    return [float(shift_timesteps(t, shift)) for t in times] if shift != 1.0 else list(times)
