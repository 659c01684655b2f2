"""DMD's optional regression loss in the student's step (``distill.regression_weight`` > 0, dfm/training/
distill_step.py): the student's first-step prediction from the pack's starting noise against the teacher's guided
Euler ODE sample from the same noise, against those written out here; its gradient; when it applies; its config.

Tiny nets called as FlowPipeline calls a model, ``net(x_in [S, D], c_noise [N], **cond)``; float64 on CPU, no
process groups (``batch`` is only the loss closure's, which these tests do not call). Through the trainer (resume,
layouts): test_distill_run.py, test_distill_layouts.py.
"""

from __future__ import annotations

import pytest
import torch

from dfm.config.errors import ConfigError
from dfm.config.loader import build_config
from dfm.diffusion import FlowPipeline, FlowSettings
from dfm.distill import Conditioning, DistillSettings, Packing
from dfm.training.distill_step import STUDENT, DistillForwardStep, Players
from tests.distill.test_dmd2 import one_thread  # noqa: F401  (autouse: one intra-op thread for tiny tensors)
from tests.training.entry import TINY

F64 = torch.float64
D = 3
# Two samples of 3 and 4 tokens; the last token of each is padding.
SAMPLE_IDS = torch.tensor([0, 0, 0, 1, 1, 1, 1])
LOSS_MASK = torch.tensor([1, 1, 0, 1, 1, 1, 0], dtype=F64)
PACKING = Packing(SAMPLE_IDS, LOSS_MASK, 2)
C_NOISE_SCALE = 1000.0
SHIFT, SIGMA_MIN = 3.0, 0.1  # not the defaults: the teacher's schedule and the clean prediction must use them


class Net(torch.nn.Module):
    """v = tanh(x W + t b) + label per sample: nonlinear in x, depends on the time and on the conditioning."""

    def __init__(self, seed: int):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(D, D, generator=generator, dtype=F64) / 2)
        self.bias = torch.nn.Parameter(torch.randn(D, generator=generator, dtype=F64))
        self.calls = 0

    def forward(self, x: torch.Tensor, c_noise: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        t = (c_noise / C_NOISE_SCALE)[SAMPLE_IDS][:, None]
        return torch.tanh(x @ self.weight + t * self.bias) + label[SAMPLE_IDS]


LABEL = torch.tensor([[0.5, -1.0, 0.25], [-0.75, 0.0, 1.5]], dtype=F64)
COND = Conditioning({"label": LABEL}, {"label": torch.zeros_like(LABEL)})


def forward_step(settings: DistillSettings, teacher_steps: int = 5) -> tuple[DistillForwardStep, Players]:
    pipe = FlowPipeline(FlowSettings(c_noise_scale=C_NOISE_SCALE, shift=SHIFT, sigma_min=SIGMA_MIN))
    players = Players(Net(1), Net(2), Net(3))
    return DistillForwardStep(STUDENT, pipe, settings, players, 0, torch.device("cpu"), teacher_steps), players


def noise(seed: int = 7) -> torch.Tensor:
    return torch.randn(len(SAMPLE_IDS), D, generator=torch.Generator().manual_seed(seed), dtype=F64)


def teacher_euler_written_out(teacher: Net, z: torch.Tensor, steps: int, scale: float) -> torch.Tensor:
    """Euler on dx/dt = uncond + s (cond - uncond) from t = 1 to 0 over the shifted uniform times."""
    times = [SHIFT * u / (1 + (SHIFT - 1) * u) for u in (1 - i / steps for i in range(steps + 1))]
    x = z
    with torch.no_grad():
        for t, t_next in zip(times, times[1:]):
            c_noise = torch.full((2,), C_NOISE_SCALE * t, dtype=F64)
            cond, uncond = teacher(x, c_noise, LABEL), teacher(x, c_noise, torch.zeros_like(LABEL))
            x = x + (t_next - t) * (uncond + scale * (cond - uncond))
    return x


def masked_mse_written_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    squared = ((a - b) ** 2).sum(-1) * LOSS_MASK
    return torch.stack([squared[SAMPLE_IDS == n].sum() / (LOSS_MASK[SAMPLE_IDS == n].sum() * D) for n in range(2)])


def student_first_step_written_out(student: Net, z: torch.Tensor) -> torch.Tensor:
    """x0 = (1 - sigma_min) z - (sigma_min + (1 - sigma_min) * 1) v(z, 1) = (1 - sigma_min) z - v(z, 1)."""
    return (1 - SIGMA_MIN) * z - student(z, torch.full((2,), C_NOISE_SCALE, dtype=F64), LABEL)


@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_regression_term_is_the_distance_to_the_teacher_euler_sample_written_out(scale):
    """A 1-step student: the term is the masked mean squared distance between its sample from the pack's noise
    and the teacher's guided Euler sample (here 5 steps at shift 3) from that noise; the student's loss is the
    DMD loss of the run without it plus the weight times the term, and the generator's draws are unchanged."""
    weight = 0.75
    with_regression = DistillSettings(student_timesteps=[1.0], guidance_scale=scale, regression_weight=weight)
    step, players = forward_step(with_regression)
    cond = COND if scale != 1.0 else Conditioning(COND.cond)
    z = noise()
    sample = step.student_sample(players.student, z, PACKING, torch.Generator().manual_seed(3), cond)
    target = teacher_euler_written_out(players.teacher, z, 5, scale)
    expected = masked_mse_written_out(student_first_step_written_out(players.student, z), target)
    before = players.teacher.calls
    torch.testing.assert_close(step.regression(sample, z, PACKING, cond), expected, rtol=1e-12, atol=0)
    assert players.teacher.calls - before == 5 * (2 if scale != 1.0 else 1)  # unguided: no unconditional pass

    plain, _ = forward_step(DistillSettings(student_timesteps=[1.0], guidance_scale=scale))
    plain.players = step.players
    generators = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    total, closure = step.student_loss(players.student, None, PACKING, z, generators[0], cond)
    dmd, plain_closure = plain.student_loss(players.student, None, PACKING, z, generators[1], cond)
    torch.testing.assert_close(total, dmd + weight * expected, rtol=1e-12, atol=0)
    assert torch.equal(torch.rand(3, generator=generators[0]), torch.rand(3, generator=generators[1]))
    logged = torch.stack([expected.mean(), torch.ones((), dtype=F64)]).float()  # [the pack's mean term, 1]
    torch.testing.assert_close(closure.args[1]["regression"], logged)
    assert plain_closure.args[1] == {}  # off: nothing computed, nothing logged


def test_regression_gradient_reaches_the_student_only():
    """d term.sum() / d x0 = 2 (x0 - target) / (real tokens x features) on real tokens, 0 on padding; the
    student's weights get a gradient, the teacher's (left trainable here on purpose) and the critic's none."""
    step, players = forward_step(DistillSettings(student_timesteps=[1.0], guidance_scale=2.0, regression_weight=1.0))
    z = noise()
    sample = step.student_sample(players.student, z, PACKING, torch.Generator().manual_seed(3), COND)
    sample.x0.retain_grad()
    step.regression(sample, z, PACKING, COND).sum().backward()
    target = teacher_euler_written_out(players.teacher, z, 5, 2.0)
    elements = torch.tensor([2 * D, 3 * D], dtype=F64)[SAMPLE_IDS][:, None]
    expected = 2 * (sample.x0.detach() - target) / elements * LOSS_MASK[:, None]
    torch.testing.assert_close(sample.x0.grad, expected, rtol=1e-12, atol=0)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in players.student.parameters())
    assert all(p.grad is None for p in (*players.teacher.parameters(), *players.critic.parameters()))


def test_a_k_step_student_regresses_the_packs_whose_first_step_was_drawn():
    """4 steps: the term (and the teacher's ODE sample) only where the backward simulation drew step 0, whose
    sample is the first-step prediction from the pack's noise; None, no teacher call and zeros logged elsewhere."""
    settings = DistillSettings(guidance_scale=2.0, regression_weight=0.5)
    z, drawn = noise(), set()
    for seed in range(12):
        step, players = forward_step(settings, teacher_steps=4)
        sample = step.student_sample(players.student, z, PACKING, torch.Generator().manual_seed(seed), COND)
        drawn.add(sample.step_index)
        term = step.regression(sample, z, PACKING, COND)
        assert (term is None) == (sample.step_index != 0) and players.teacher.calls == (8 if term is not None else 0)
        if term is not None:
            first = student_first_step_written_out(players.student, z)
            target = teacher_euler_written_out(players.teacher, z, 4, 2.0)
            torch.testing.assert_close(term, masked_mse_written_out(first, target), rtol=1e-12, atol=0)
        _, closure = step.student_loss(players.student, None, PACKING, z, torch.Generator().manual_seed(seed), COND)
        logged = closure.args[1]["regression"]  # [the pack's mean term, 1] or zeros
        assert logged[1].item() == (0.0 if term is None else 1.0) and (term is not None or logged[0].item() == 0)
    assert 0 in drawn and len(drawn) > 1


def test_regression_is_accepted_and_its_teacher_steps_are_checked():
    overrides = ["distill.enabled=true", "model.pipeline=flow", "checkpoint.pretrained=x"]
    cfg = build_config(None, str(TINY), [*overrides, "distill.regression_weight=0.25"])
    assert cfg.distill.regression_weight == 0.25 and cfg.distill.regression_teacher_steps == 12
    assert build_config(None, str(TINY), overrides).distill.regression_weight == 0  # off by default
    with pytest.raises(ConfigError, match="distill.regression_teacher_steps"):
        build_config(None, str(TINY), [*overrides, "distill.regression_teacher_steps=0"])


def test_the_console_line_shows_the_regression_loss_when_there_is_one():
    from dfm.training.distill_loop import DistillPlayers
    from dfm.training.distill_step import COLLAPSE_KEYS

    record = {
        "iteration": 4,
        "train_iters": 4,
        "critic_loss": 0.5,
        "student_loss": 0.25,
        "student_iteration": 4,
        "student_regression_loss": 0.125,
        "critic_grad_norm": 1.0,
        "student_grad_norm": 2.0,
        "critic_lr": 1e-4,
        "student_lr": 1e-4,
        "skipped_iterations": 0,
        "step_time_s": 0.1,
        "tokens_per_sec_per_gpu": 10.0,
        **dict.fromkeys(COLLAPSE_KEYS, 1.0),
    }
    assert "student loss 0.25 (iter 4) | regression 0.125 | grad norm" in DistillPlayers.console_line(record)
    assert "regression" not in DistillPlayers.console_line(record | {"student_regression_loss": None})
