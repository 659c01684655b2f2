"""Flow-matching formulas, timestep distributions, the pipeline factory and CFG dropout."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from dfm.diffusion import (
    FlowPipeline,
    FlowSettings,
    SamplingOptions,
    apply_cfg_dropout,
    build_pipeline,
    cfg_drop_mask,
    shift_for_num_tokens,
)
from dfm.diffusion.samplers import flow_timesteps, shift_timesteps

N_DRAWS = 20_000
P_MIN = 0.01  # KS tests with a fixed seed: deterministic, and a correct sampler passes with margin


def test_interpolation_and_velocity_target_match_the_definition():
    pipe = FlowPipeline()
    sample_ids = torch.tensor([0, 0, 1, 1, 1])
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)
    t = torch.tensor([0.25, 0.9])
    x_t, c_noise = pipe.model_input(x0, noise, t, sample_ids)
    tok_t = t[sample_ids][:, None]
    torch.testing.assert_close(x_t, (1 - tok_t) * x0 + tok_t * noise)
    torch.testing.assert_close(c_noise, t)
    torch.testing.assert_close(pipe.target_velocity(x0, noise), noise - x0)
    # Endpoints: data at t = 0, noise at t = 1.
    torch.testing.assert_close(pipe.interpolate(x0, noise, torch.tensor([0.0, 0.0]), sample_ids), x0)
    torch.testing.assert_close(pipe.interpolate(x0, noise, torch.tensor([1.0, 1.0]), sample_ids), noise)


def test_sigma_min_path_and_its_velocity():
    pipe = FlowPipeline(FlowSettings(sigma_min=0.1))
    ids = torch.zeros(3, dtype=torch.long)
    g = torch.Generator().manual_seed(1)
    x0, noise = torch.randn(3, 2, generator=g, dtype=torch.float64), torch.randn(3, 2, generator=g, dtype=torch.float64)

    def at(t):
        return pipe.interpolate(x0, noise, torch.tensor([t], dtype=torch.float64), ids)

    torch.testing.assert_close(at(0.0), x0 + 0.1 * noise)
    h = 1e-4
    finite_difference = (at(0.4 + h) - at(0.4 - h)) / (2 * h)
    torch.testing.assert_close(finite_difference, pipe.target_velocity(x0, noise), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("sigma_min", [0.0, 0.1])
def test_denoise_recovers_data_from_the_true_velocity(sigma_min):
    pipe = FlowPipeline(FlowSettings(sigma_min=sigma_min))
    ids = torch.tensor([0, 1, 1])
    g = torch.Generator().manual_seed(2)
    x0, noise = torch.randn(3, 2, generator=g), torch.randn(3, 2, generator=g)
    t = torch.tensor([0.3, 0.8])
    x_t = pipe.interpolate(x0, noise, t, ids)

    def true_velocity(x, c_noise):
        return pipe.target_velocity(x0, noise)

    torch.testing.assert_close(pipe.denoise(true_velocity, x_t, t, ids), x0)


def test_c_noise_scale():
    pipe = FlowPipeline(FlowSettings(c_noise_scale=1000.0))
    _, c_noise = pipe.model_input(torch.zeros(2, 1), torch.zeros(2, 1), torch.tensor([0.25, 0.5]), torch.arange(2))
    torch.testing.assert_close(c_noise, torch.tensor([250.0, 500.0]))


# ---------------------------------------------------------------------------------------------
# Timestep distributions and the shift
# ---------------------------------------------------------------------------------------------


def draw(settings: FlowSettings, seed: int = 0) -> np.ndarray:
    return FlowPipeline(settings).draw_t(N_DRAWS, torch.Generator().manual_seed(seed)).double().numpy()


def test_uniform_timesteps():
    assert stats.kstest(draw(FlowSettings(timestep_sampling="uniform")), "uniform").pvalue > P_MIN


@pytest.mark.parametrize("mean, std", [(0.0, 1.0), (0.5, 0.8)])
def test_logit_normal_timesteps(mean, std):
    t = draw(FlowSettings(timestep_sampling="logit_normal", logit_mean=mean, logit_std=std))
    assert ((t > 0) & (t < 1)).all()
    assert stats.kstest(np.log(t / (1 - t)), "norm", args=(mean, std)).pvalue > P_MIN


def test_shifted_uniform_timesteps_follow_the_mapped_distribution():
    """t' = s t / (1 + (s - 1) t) is increasing, so P(t' <= y) = P(t <= y / (s - (s - 1) y))."""
    shift = 3.0
    t = draw(FlowSettings(timestep_sampling="uniform", shift=shift))

    def cdf(y):
        return np.clip(y / (shift - (shift - 1) * y), 0, 1)

    assert stats.kstest(t, cdf).pvalue > P_MIN
    assert np.median(t) == pytest.approx(0.75, abs=0.02)  # the median 0.5 maps to 1.5 / 2


def test_shift_mapping_by_hand():
    assert shift_timesteps(0.5, 3.0) == pytest.approx(0.75)
    assert shift_timesteps(0.25, 3.0) == pytest.approx(0.75 / 1.5)
    assert shift_timesteps(0.0, 3.0) == 0.0 and shift_timesteps(1.0, 3.0) == pytest.approx(1.0)
    assert shift_timesteps(0.3, 1.0) == pytest.approx(0.3)
    per_sample = shift_timesteps(torch.tensor([0.5, 0.5]), torch.tensor([1.0, 3.0]))
    torch.testing.assert_close(per_sample, torch.tensor([0.5, 0.75]))


def test_shift_from_token_count():
    """ln(shift) is linear in the token count through (256, 0.5) and (4096, 1.15)."""
    assert shift_for_num_tokens(256) == pytest.approx(math.exp(0.5))
    assert shift_for_num_tokens(4096) == pytest.approx(math.exp(1.15))
    assert shift_for_num_tokens(2176) == pytest.approx(math.exp(0.825))
    tokens = torch.tensor([256.0, 4096.0])
    torch.testing.assert_close(shift_for_num_tokens(tokens), torch.tensor([math.exp(0.5), math.exp(1.15)]))


def test_sampling_schedule_runs_from_noise_to_data_over_the_shift():
    times = flow_timesteps(4, shift=3.0)
    assert times[0] == pytest.approx(1.0) and times[-1] == 0.0
    assert times == pytest.approx([shift_timesteps(t, 3.0) for t in [1.0, 0.75, 0.5, 0.25, 0.0]])


# ---------------------------------------------------------------------------------------------
# Factory
# ---------------------------------------------------------------------------------------------


def test_build_pipeline():
    assert isinstance(build_pipeline("flow", shift=3.0, sampler="heun"), FlowPipeline)
    assert build_pipeline("edm", sigma_data=1.0).settings.sigma_data == 1.0
    with pytest.raises(ValueError, match="edm, flow"):
        build_pipeline("ddpm")
    with pytest.raises(TypeError):
        build_pipeline("flow", not_a_setting=1)
    with pytest.raises(ValueError, match="logit_normal"):
        build_pipeline("flow", timestep_sampling="cosine")


# ---------------------------------------------------------------------------------------------
# Classifier-free-guidance dropout
# ---------------------------------------------------------------------------------------------


def packed_context():
    """Three samples with 2, 3 and 1 text tokens, padded to segments of 3, 3, 2."""
    cu_seqlens_kv_padded = torch.tensor([0, 3, 6, 8], dtype=torch.int32)
    context = torch.arange(1, 8 * 4 + 1, dtype=torch.float32).reshape(8, 4)
    return context, cu_seqlens_kv_padded


def test_cfg_dropout_nulls_whole_samples_deterministically():
    context, cu = packed_context()
    out_a = apply_cfg_dropout(context, cu, 0.5, torch.Generator().manual_seed(11))
    out_b = apply_cfg_dropout(context, cu, 0.5, torch.Generator().manual_seed(11))
    torch.testing.assert_close(out_a, out_b)
    dropped = cfg_drop_mask(3, 0.5, torch.Generator().manual_seed(11))
    for i in range(3):
        segment = slice(int(cu[i]), int(cu[i + 1]))
        expected = torch.zeros_like(context[segment]) if dropped[i] else context[segment]
        torch.testing.assert_close(out_a[segment], expected)
    assert context.abs().min() > 0  # the input is left untouched


def test_cfg_dropout_probability_and_edge_cases():
    context, cu = packed_context()
    torch.testing.assert_close(apply_cfg_dropout(context, cu, 0.0, torch.Generator()), context)
    assert (apply_cfg_dropout(context, cu, 1.0, torch.Generator()) == 0).all()
    rate = cfg_drop_mask(N_DRAWS, 0.1, torch.Generator().manual_seed(0)).float().mean().item()
    assert rate == pytest.approx(0.1, abs=0.01)  # 0.01 is 4.7 standard errors
    with pytest.raises(ValueError, match="padded"):
        apply_cfg_dropout(context[:7], cu, 0.5, torch.Generator())


@pytest.mark.parametrize("name", ["edm", "flow"])
def test_bf16_activations_keep_fp32_noise_levels_loss_and_sampling(name):
    pipe = build_pipeline(name)
    ids, mask = torch.tensor([0, 0, 1]), torch.ones(3)
    x0 = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)).bfloat16()
    noise, level = pipe.draw_training_noise(2, x0.shape, torch.Generator().manual_seed(1))
    x_in, c_noise = pipe.model_input(x0, noise, level, ids)
    assert x_in.dtype == torch.bfloat16 and c_noise.dtype == torch.float32
    loss = pipe.training_loss(torch.zeros_like(x0), x0, noise, level, ids, mask)
    assert loss.dtype == torch.float32 and loss.shape == (2,)

    def net(x_in, c_noise):
        return torch.zeros_like(x_in, dtype=torch.bfloat16)

    samples = pipe.sample(net, noise.bfloat16(), ids, SamplingOptions(4))
    assert samples.dtype == torch.float32 and torch.isfinite(samples).all()
