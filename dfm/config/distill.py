"""The ``distill`` config section: DMD2 distillation of the ``checkpoint.pretrained`` flow model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

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

    def settings(self) -> DistillSettings:
        """The DMD2 settings as the config holds them now, checked (ValueError names the key)."""
        return DistillSettings(**{item.name: getattr(self, item.name) for item in dataclasses.fields(DistillSettings)})
