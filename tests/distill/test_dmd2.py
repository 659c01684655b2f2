"""DMD2's building blocks (dfm/distill) against formulas written out by hand and an exact Gaussian case.

The nets are closed-form callables or tiny nn.Linear's called as FlowPipeline calls a model,
``net(x_in [S, D], c_noise [N], **cond)``; everything is float64 on CPU, with no process groups.
"""

from __future__ import annotations

import math

import pytest
import torch

from dfm.diffusion import FlowPipeline, FlowSettings, SamplingOptions
from dfm.distill import (
    Conditioning,
    DistillSettings,
    Packing,
    ScoreNets,
    collapse_statistics,
    critic_loss,
    distribution_matching_loss,
    dmd_gradient,
    generate_student_sample,
    per_step_collapse_statistics,
    regression_loss,
    student_trajectory,
)
from dfm.distill.student_sampling import choose_step

F64 = torch.float64
D = 3  # features per token
# Three samples of 3, 2 and 4 tokens; the last token of samples 0 and 2 is padding.
SAMPLE_IDS = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
LOSS_MASK = torch.tensor([1, 1, 0, 1, 1, 1, 1, 1, 0], dtype=torch.float32)
PACKING = Packing(SAMPLE_IDS, LOSS_MASK, 3)
C_NOISE_SCALE = 1000.0  # the nets divide it out, so a wrong c_noise shows as a wrong prediction


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only contend on a busy 2-core runner."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def linear_velocity(seed: int, sample_ids: torch.Tensor = SAMPLE_IDS):
    """v = x W + t b + context: affine in x, depends on the time and on the conditioning."""
    weight, bias = randn(D, D, seed=seed) / 2, randn(D, seed=seed + 1)

    def net(x: torch.Tensor, c_noise: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        t = (c_noise / C_NOISE_SCALE)[sample_ids][:, None]
        out = x @ weight + t * bias
        return out if context is None else out + context[sample_ids]

    return net


def with_padding_garbage(x: torch.Tensor, garbage: float = float("nan")) -> torch.Tensor:
    """``garbage`` on the padding tokens: nothing computed for real tokens may depend on them."""
    return torch.where(LOSS_MASK[:, None] > 0, x, torch.full_like(x, garbage))


# ---------------------------------------------------------------------------------------------
# The distribution-matching gradient
# ---------------------------------------------------------------------------------------------


def test_surrogate_gradient_is_the_dmd_gradient_written_out():
    """x0.grad of loss.sum() equals g = (fake - real) / mean|x0 - real| with x_t, the guided teacher's
    clean prediction and the critic's computed here from the flow formulas directly."""
    pipe = FlowPipeline(FlowSettings(c_noise_scale=C_NOISE_SCALE))
    settings = DistillSettings(guidance_scale=3.0, min_t=0.1, max_t=0.9)
    teacher, critic = linear_velocity(seed=1), linear_velocity(seed=2)
    context = randn(3, D, seed=3)
    conditioning = Conditioning({"context": context}, {"context": torch.zeros_like(context)})
    x0 = with_padding_garbage(randn(9, D, seed=4)).requires_grad_()

    result = distribution_matching_loss(
        pipe, ScoreNets(teacher, critic), x0, PACKING, settings, conditioning, torch.Generator().manual_seed(5)
    )
    result.loss.sum().backward()

    # By hand, drawing as documented: the times first, then the noise.
    generator = torch.Generator().manual_seed(5)
    t = (0.1 + 0.8 * torch.rand(3, generator=generator)).to(F64)  # drawn in fp32, as training times are
    noise = torch.randn(9, D, generator=generator, dtype=F64)
    t_tok, c_noise, x = t[SAMPLE_IDS][:, None], C_NOISE_SCALE * t, x0.detach()
    x_t = (1 - t_tok) * x + t_tok * noise
    v_real = teacher(x_t, c_noise) + 3.0 * (teacher(x_t, c_noise, context) - teacher(x_t, c_noise))
    real = x_t - t_tok * v_real  # x0 = x_t - t v for sigma_min = 0
    fake = x_t - t_tok * critic(x_t, c_noise, context)
    real_token = LOSS_MASK > 0
    normaliser = torch.stack([(x - real)[real_token & (SAMPLE_IDS == i)].abs().mean() for i in range(3)])
    expected = torch.where(real_token[:, None], (fake - real) / normaliser[SAMPLE_IDS][:, None], 0.0)

    assert torch.equal(result.level.to(F64), t)
    torch.testing.assert_close(x0.grad, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(result.gradient, expected, rtol=1e-12, atol=1e-12)
    # The loss is 0.5 ||g||^2 per sample over its real elements; elements = real tokens x features.
    torch.testing.assert_close(result.elements, torch.tensor([2.0, 2.0, 3.0]) * D)
    per_sample = torch.stack([(expected[SAMPLE_IDS == i] ** 2).sum() / 2 for i in range(3)])
    torch.testing.assert_close(result.loss, per_sample, rtol=1e-12, atol=1e-12)


def test_teacher_equal_to_critic_gives_exactly_zero_gradient():
    """The student's samples already have the teacher's distribution as far as the critic can tell."""
    pipe = FlowPipeline(FlowSettings(c_noise_scale=C_NOISE_SCALE))
    net = linear_velocity(seed=1)
    context = randn(3, D, seed=3)
    x0 = randn(9, D, seed=4).requires_grad_()
    result = distribution_matching_loss(
        pipe, ScoreNets(net, net), x0, PACKING, DistillSettings(), Conditioning({"context": context})
    )
    result.loss.sum().backward()
    assert torch.equal(result.gradient, torch.zeros_like(x0))
    assert torch.equal(x0.grad, torch.zeros_like(x0))
    assert torch.equal(result.loss, torch.zeros(3, dtype=F64))


def test_guidance_needs_the_unconditional_inputs():
    pipe = FlowPipeline()
    net = linear_velocity(seed=1)
    with pytest.raises(ValueError, match="guidance_scale=4.0 needs the unconditional"):
        distribution_matching_loss(
            pipe, ScoreNets(net, net), randn(9, D, seed=1), PACKING, DistillSettings(guidance_scale=4.0)
        )


def test_a_zero_normaliser_gives_a_zero_gradient():
    """A sample equal to the teacher's prediction everywhere: g = 0, not 0/0."""
    x0 = randn(9, D, seed=1)
    real = x0.clone()
    real[SAMPLE_IDS != 1] += 1.0  # samples 0 and 2 differ from the teacher's prediction, sample 1 does not
    gradient = dmd_gradient(x0, real, real + 2.0, PACKING)
    assert torch.equal(gradient[SAMPLE_IDS == 1], torch.zeros(2, D, dtype=F64))
    torch.testing.assert_close(gradient[(SAMPLE_IDS != 1) & (LOSS_MASK > 0)], torch.full((5, D), 2.0, dtype=F64))


# ---------------------------------------------------------------------------------------------
# Exact case: Gaussian data, an affine one-step student, exact scores
# ---------------------------------------------------------------------------------------------


def gaussian_velocity(pipe: FlowPipeline, mean: float | torch.Tensor, std: float | torch.Tensor):
    """The exact flow velocity E[(1 - sigma_min) n - x0 | x_t] of data N(mean, std^2) per feature:
    x_t ~ N((1 - t) mean, (1 - t)^2 std^2 + sigma(t)^2) and both conditional means are linear in x_t."""

    def net(x: torch.Tensor, c_noise: torch.Tensor) -> torch.Tensor:
        t = (c_noise / pipe.settings.c_noise_scale)[:, None]  # one token per sample
        sigma = pipe.noise_scale(t)
        variance = (1 - t) ** 2 * std**2 + sigma**2
        residual = x - (1 - t) * mean
        clean = mean + (1 - t) * std**2 / variance * residual
        noise = sigma / variance * residual
        return (1 - pipe.settings.sigma_min) * noise - clean

    return net


def affine_student(pipe: FlowPipeline, shift: torch.Tensor, scale: torch.Tensor):
    """A one-step student whose clean prediction from pure noise z is shift + scale z, i.e. whose samples
    are N(shift, scale^2): at t = 1, x0_hat = (1 - sigma_min) z - v."""
    return lambda x, c_noise: (1 - pipe.settings.sigma_min) * x - (shift + scale * x)


def gaussian_kl(mean: float, std: float, data_mean: float, data_std: float) -> float:
    """KL(N(mean, std^2) || N(data_mean, data_std^2)) per feature."""
    return math.log(data_std / std) + (std**2 + (mean - data_mean) ** 2) / (2 * data_std**2) - 0.5


@pytest.mark.parametrize("flow", [{}, {"c_noise_scale": 1000.0, "sigma_min": 0.01}])
def test_dmd_gradient_moves_a_gaussian_student_to_the_data(flow):
    """Data N(1.5, 0.6^2) per feature; the student starts at N(0, 1.2^2). With the teacher's and the
    critic's exact velocities (the critic: the student's current distribution), plain gradient descent
    on the surrogate brings (shift, scale) to (1.5, 0.6): the sign of g (towards real, away from fake),
    its normalisation and the velocity-to-clean-prediction relation are right, or it would not."""
    pipe = FlowPipeline(FlowSettings(**flow))
    data_mean, data_std = 1.5, 0.6
    shift = torch.tensor(0.0, dtype=F64, requires_grad=True)
    scale = torch.tensor(1.2, dtype=F64, requires_grad=True)
    settings = DistillSettings(student_timesteps=[1.0])
    num_samples, features = 64, 16
    packing = Packing.unpadded(torch.arange(num_samples))
    generator = torch.Generator().manual_seed(0)

    def kl() -> float:
        student_std = scale.item() - pipe.settings.sigma_min  # x0 = shift + (scale - sigma_min) z
        return gaussian_kl(shift.item(), student_std, data_mean, data_std)

    kls = [kl()]
    for _ in range(20):
        noise = torch.randn(num_samples, features, generator=generator, dtype=F64)
        sample = generate_student_sample(pipe, affine_student(pipe, shift, scale), noise, packing, settings, generator)
        student_std = (scale.detach() - pipe.settings.sigma_min).abs()
        scores = ScoreNets(
            gaussian_velocity(pipe, data_mean, data_std), gaussian_velocity(pipe, shift.detach(), student_std)
        )
        result = distribution_matching_loss(pipe, scores, sample.x0, packing, settings, generator=generator)
        (result.loss.sum() / result.elements.sum()).backward()  # the DMD2 reference's mean-squared scale
        with torch.no_grad():  # plain gradient descent, learning rate 0.5
            for parameter in (shift, scale):
                parameter -= 0.5 * parameter.grad
                parameter.grad = None
        kls.append(kl())

    assert kls[0] > 3.0 and kls[5] < kls[0] / 10 and kls[-1] < 1e-6, kls
    assert abs(shift.item() - data_mean) < 1e-3
    assert abs(scale.item() - pipe.settings.sigma_min - data_std) < 1e-3


# ---------------------------------------------------------------------------------------------
# The student's generation and backward simulation
# ---------------------------------------------------------------------------------------------


class RecordingStudent(torch.nn.Module):
    """A tiny nonlinear velocity net that records every call: its input and whether grad was on."""

    def __init__(self, sample_ids: torch.Tensor) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(D, D, dtype=F64)
        self.sample_ids = sample_ids
        self.calls: list[tuple[torch.Tensor, bool]] = []

    def forward(self, x: torch.Tensor, c_noise: torch.Tensor) -> torch.Tensor:
        self.calls.append((x, torch.is_grad_enabled()))
        return torch.tanh(self.linear(x)) + c_noise[self.sample_ids][:, None]


STEPS = [1.0, 0.75, 0.5, 0.25]


def test_backward_simulation_keeps_the_graph_of_the_chosen_step_only():
    pipe = FlowPipeline()
    settings = DistillSettings(student_timesteps=STEPS)
    packing = Packing.unpadded(SAMPLE_IDS)
    seen = set()
    for seed in range(12):
        student = RecordingStudent(SAMPLE_IDS)
        sample = generate_student_sample(
            pipe, student, randn(9, D, seed=seed), packing, settings, torch.Generator().manual_seed(seed)
        )
        seen.add(sample.step_index)
        assert sample.level == STEPS[sample.step_index]
        # One call per step up to the chosen one; grad only in the chosen one, whose input has no graph.
        assert [grad for _, grad in student.calls] == [False] * sample.step_index + [True]
        chosen_input = student.calls[-1][0]
        assert all(not x.requires_grad for x, _ in student.calls)
        # The gradient of anything of x0 is that of the chosen step's call alone on its input.
        sample.x0.square().sum().backward()
        through_sample = [p.grad.clone() for p in student.parameters()]
        student.zero_grad()
        pipe.denoise(student, chosen_input, sample.level, SAMPLE_IDS).square().sum().backward()
        for got, expected in zip(through_sample, [p.grad for p in student.parameters()]):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert seen == {0, 1, 2, 3}  # every step gets chosen (uniformly, from the generator)


def test_backward_simulation_reaches_the_inference_trajectory():
    """The chosen step's sample is the one generation reaches at that step from the same noise and draws."""
    pipe = FlowPipeline()
    settings = DistillSettings(student_timesteps=STEPS)
    packing = Packing.unpadded(SAMPLE_IDS)
    student = RecordingStudent(SAMPLE_IDS)
    noise = randn(9, D, seed=7)
    for seed in range(6):
        generator = torch.Generator().manual_seed(seed)
        index = choose_step(len(STEPS), generator)  # generate_student_sample draws the step first
        trajectory = student_trajectory(pipe, student, noise, packing, settings, generator)
        sample = generate_student_sample(pipe, student, noise, packing, settings, torch.Generator().manual_seed(seed))
        assert sample.step_index == index and len(trajectory) == len(STEPS)
        torch.testing.assert_close(sample.x0.detach(), trajectory[index], rtol=0, atol=0)


def test_one_step_student_is_one_euler_step_from_noise():
    pipe = FlowPipeline(FlowSettings(c_noise_scale=C_NOISE_SCALE))
    student = linear_velocity(seed=3)
    noise = randn(9, D, seed=8)
    packing = Packing.unpadded(SAMPLE_IDS)
    sample = generate_student_sample(pipe, student, noise, packing, DistillSettings(student_timesteps=[1.0]))
    assert sample.step_index == 0
    one_euler_step = pipe.sample(student, noise, SAMPLE_IDS, SamplingOptions(steps=1))
    torch.testing.assert_close(sample.x0, one_euler_step, rtol=0, atol=1e-15)
    torch.testing.assert_close(sample.x0, noise - student(noise, torch.full((3,), C_NOISE_SCALE, dtype=F64)))


# ---------------------------------------------------------------------------------------------
# The critic's loss, the regression loss, the settings
# ---------------------------------------------------------------------------------------------


def test_critic_loss_is_the_flow_matching_loss_on_detached_student_samples():
    pipe = FlowPipeline(FlowSettings(c_noise_scale=C_NOISE_SCALE))
    settings = DistillSettings(min_t=0.3, max_t=0.6)
    critic = torch.nn.Linear(D, D, dtype=F64)
    context = randn(3, D, seed=2)

    def net(x, c_noise, context):
        return critic(x) + c_noise[SAMPLE_IDS][:, None] / C_NOISE_SCALE + context[SAMPLE_IDS]

    # Finite garbage: a NaN input would reach the critic's weight gradient through its own matmul.
    x0 = with_padding_garbage(randn(9, D, seed=4), garbage=1e6).requires_grad_()
    loss = critic_loss(
        pipe, net, x0, PACKING, settings, Conditioning({"context": context}), torch.Generator().manual_seed(1)
    )
    loss.sum().backward()

    generator = torch.Generator().manual_seed(1)
    t = (0.3 + 0.3 * torch.rand(3, generator=generator)).to(F64)
    noise = torch.randn(9, D, generator=generator, dtype=F64)
    t_tok = t[SAMPLE_IDS][:, None]
    x_t = (1 - t_tok) * x0.detach() + t_tok * noise
    squared = (net(x_t, C_NOISE_SCALE * t, context) - (noise - x0.detach())) ** 2
    real = LOSS_MASK > 0
    expected = torch.stack([squared[real & (SAMPLE_IDS == i)].mean() for i in range(3)])
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    assert x0.grad is None  # the critic's update leaves the student's graph alone
    assert critic.weight.grad is not None and critic.weight.grad.abs().sum() > 0


def test_regression_loss_is_a_masked_mean_squared_distance():
    x0 = with_padding_garbage(randn(9, D, seed=1))
    target = randn(9, D, seed=2)
    expected = torch.stack([((x0 - target)[(LOSS_MASK > 0) & (SAMPLE_IDS == i)] ** 2).mean() for i in range(3)])
    torch.testing.assert_close(regression_loss(x0, target, PACKING), expected)
    assert torch.equal(regression_loss(target, target, PACKING), torch.zeros(3, dtype=F64))


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"student_timesteps": [0.9, 0.5]}, "must start at 1.0"),
        ({"student_timesteps": [1.0, 0.5, 0.5]}, "decrease strictly"),
        ({"student_timesteps": [1.0, 0.0]}, "stay above 0"),
        ({"critic_steps": 0}, "critic_steps"),
        ({"min_t": 0.0}, "min_t"),
        ({"min_t": 0.5, "max_t": 0.4}, "min_t"),
        ({"regression_weight": -1.0}, "regression_weight"),
        ({"gan_critic_weight": -1.0}, "gan_critic_weight"),
        ({"gan_student_weight": 0.1}, "gan_student_weight=0.1 needs distill.gan_critic_weight > 0"),
    ],
)
def test_settings_refuse_what_cannot_work(fields, message):
    with pytest.raises(ValueError, match=message):
        DistillSettings(**fields)


def test_two_time_scale_rule_updates_the_student_every_critic_steps_iterations():
    settings = DistillSettings(critic_steps=3)
    assert [settings.updates_student(i) for i in range(7)] == [False, False, True, False, False, True, False]
    assert all(DistillSettings(critic_steps=1).updates_student(i) for i in range(3))


# ---------------------------------------------------------------------------------------------
# Collapse statistics
# ---------------------------------------------------------------------------------------------


def test_a_collapsed_batch_has_zero_diversity():
    one = randn(2, D, seed=1)
    packing = Packing.unpadded(torch.arange(5).repeat_interleave(2))
    collapsed = one.repeat(5, 1)  # five equal samples of two tokens
    diverse = randn(10, D, seed=2)
    stats = collapse_statistics(collapsed, packing, reference=diverse)
    assert stats.pairwise_distance == 0.0 and stats.diversity == 0.0
    torch.testing.assert_close(stats.mean, one.mean().expand(5))
    torch.testing.assert_close(stats.std, one.std(unbiased=False).expand(5))  # per-sample spread stays
    assert collapse_statistics(diverse, packing, reference=diverse).diversity == pytest.approx(1.0)
    rows = diverse.reshape(5, -1)
    pairs = [(rows[i] - rows[j]).norm() / math.sqrt(2 * D) for i in range(5) for j in range(i + 1, 5)]
    assert collapse_statistics(diverse, packing).diversity == pytest.approx(float(torch.stack(pairs).mean()))


def test_collapse_statistics_per_student_step_and_refusals():
    pipe = FlowPipeline()
    packing = Packing.unpadded(torch.arange(4).repeat_interleave(2))
    student = RecordingStudent(packing.sample_ids)
    trajectory = student_trajectory(
        pipe, student, randn(8, D, seed=3), packing, DistillSettings(student_timesteps=STEPS)
    )
    stats = per_step_collapse_statistics(trajectory, packing)
    assert len(stats) == len(STEPS) and all(s.diversity > 0 and s.std.shape == (4,) for s in stats)
    with pytest.raises(ValueError, match="one token count"):
        collapse_statistics(randn(9, D, seed=1), PACKING)  # 3, 2 and 4 tokens: no common vector
