"""Distribution-matching distillation (DMD2) of a flow-matching model into a few-step student.

Building blocks the trainer calls: the settings, the student's backward-simulated generation, the
distribution-matching, critic, regression and GAN losses, and collapse statistics (docs/distillation.md).
"""

from dfm.distill.batch import Conditioning, Packing
from dfm.distill.collapse import CollapseStatistics, collapse_statistics, per_step_collapse_statistics
from dfm.distill.dmd2 import (
    DistributionMatching,
    ScoreNets,
    classifier_logits,
    critic_loss,
    distribution_matching_loss,
    dmd_gradient,
    dmd_surrogate,
    gan_critic_loss,
    gan_student_loss,
    regression_loss,
)
from dfm.distill.settings import DistillSettings
from dfm.distill.student_sampling import StudentSample, generate_student_sample, student_trajectory

__all__ = [
    "CollapseStatistics",
    "Conditioning",
    "DistillSettings",
    "DistributionMatching",
    "Packing",
    "ScoreNets",
    "StudentSample",
    "classifier_logits",
    "collapse_statistics",
    "critic_loss",
    "distribution_matching_loss",
    "dmd_gradient",
    "dmd_surrogate",
    "gan_critic_loss",
    "gan_student_loss",
    "generate_student_sample",
    "per_step_collapse_statistics",
    "regression_loss",
    "student_trajectory",
]
