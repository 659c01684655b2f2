"""What a DMD2 distillation run of a flow-matching model is set to.

Times are the flow pipeline's t: data at t = 0, noise at t = 1 (dfm/diffusion/flow.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DistillSettings:
    """DMD2 (Yin et al. 2024, "Improved Distribution Matching Distillation") for a flow pipeline.

    Shapes the pieces work on: a pack of N samples as tokens ``[S, *]`` with ``sample_ids [S]``
    (dfm/distill/batch.py); one re-noising time per sample ``[N]``.
    """

    # The student's k steps, in t, strictly decreasing from 1.0 (pure noise): each step predicts the
    # clean sample, which is re-noised with fresh noise to the next time. [1.0]: one-step generation.
    student_timesteps: list[float] = field(default_factory=lambda: [1.0, 0.75, 0.5, 0.25])
    # Classifier-free guidance of the teacher's (real score) clean prediction; DMD bakes it into the
    # student, which then samples unguided. 1: the conditional prediction alone.
    guidance_scale: float = 1.0
    # Two-time-scale update rule: the critic (fake score) takes this many updates per student update.
    critic_steps: int = 5
    # Re-noising law of the distribution-matching and critic losses: t ~ U[min_t, max_t]. Ends are left
    # out: near t = 0 teacher and critic both return their input (the gradient and its normaliser
    # vanish), near t = 1 the input holds nothing of the sample. DMD2 uses 2% and 98% of its schedule.
    min_t: float = 0.02
    max_t: float = 0.98
    # Weight of the regression loss against teacher samples from the same noise (DMD's paired loss;
    # DMD2 drops it). 0: off.
    regression_weight: float = 0.0
    # DMD2's GAN loss: a classifier on the critic's last hidden states, pooled per sample, tells the pack's
    # real latents from the student's samples, both re-noised (dfm/models/common/sample_classifier.py). The critic's
    # step adds ``gan_critic_weight`` times its loss, the student's ``gan_student_weight`` times the
    # non-saturating generator loss through the critic. 0 and 0: off (no classifier is built).
    gan_critic_weight: float = 0.0
    gan_student_weight: float = 0.0

    def __post_init__(self) -> None:
        steps = self.student_timesteps
        if not steps or steps[0] != 1.0:
            raise ValueError(f"distill.student_timesteps must start at 1.0 (pure noise), got {steps}")
        if any(later >= earlier for earlier, later in zip(steps, steps[1:])) or steps[-1] <= 0:
            raise ValueError(f"distill.student_timesteps must decrease strictly and stay above 0, got {steps}")
        if self.critic_steps < 1:
            raise ValueError(f"distill.critic_steps must be >= 1, got {self.critic_steps}")
        if not 0 < self.min_t < self.max_t <= 1:
            raise ValueError(f"need 0 < distill.min_t < distill.max_t <= 1, got {self.min_t}, {self.max_t}")
        if self.regression_weight < 0:
            raise ValueError(f"distill.regression_weight must be >= 0, got {self.regression_weight}")
        if self.gan_critic_weight < 0 or self.gan_student_weight < 0:
            raise ValueError(
                f"distill.gan_critic_weight and distill.gan_student_weight must be >= 0, got "
                f"{self.gan_critic_weight}, {self.gan_student_weight}"
            )
        if self.gan_student_weight > 0 and self.gan_critic_weight == 0:
            raise ValueError(
                f"distill.gan_student_weight={self.gan_student_weight} needs distill.gan_critic_weight > 0: "
                "the classifier it reads is trained by the critic's GAN loss"
            )

    @property
    def gan(self) -> bool:
        """Whether the GAN loss is on (the critic then carries a classifier)."""
        return self.gan_critic_weight > 0

    def updates_student(self, iteration: int) -> bool:
        """Whether ``iteration`` (counted from 0) also updates the student; every one updates the critic."""
        return iteration % self.critic_steps == self.critic_steps - 1
