"""EDM formulas (Karras et al. 2022, Table 1) and the packed per-sample loss."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from scipy import stats

from dfm.diffusion import EDMPipeline, EDMSettings, build_pipeline, masked_mean_per_sample
from dfm.diffusion.samplers import karras_sigmas

# Hand-computed from Table 1: c_skip = sd^2/(s^2+sd^2), c_out = s sd/sqrt(s^2+sd^2),
# c_in = 1/sqrt(s^2+sd^2), c_noise = ln(s)/4, lambda = (s^2+sd^2)/(s sd)^2.
TABLE = [
    # sigma, sigma_data, c_skip,      c_out,       c_in,        c_noise,     lambda
    (1.0, 0.5, 0.2, 0.4472135955, 0.8944271910, 0.0, 5.0),
    (2.0, 0.5, 0.0588235294, 0.4850712501, 0.4850712501, 0.1732867951, 4.25),
    (0.5, 1.0, 0.8, 0.4472135955, 0.8944271910, -0.1732867951, 5.0),
    (80.0, 0.5, 3.9060974e-05, 0.4999902347, 0.0124997559, 1.0955066587, 4.00015625),
]


@pytest.mark.parametrize("sigma, sigma_data, c_skip, c_out, c_in, c_noise, weight", TABLE)
def test_preconditioning_and_loss_weight_match_table_1(sigma, sigma_data, c_skip, c_out, c_in, c_noise, weight):
    pipe = EDMPipeline(EDMSettings(sigma_data=sigma_data))
    s = torch.tensor([sigma], dtype=torch.float64)
    c = pipe.preconditioning(s)
    expected = {"c_skip": c_skip, "c_out": c_out, "c_in": c_in, "c_noise": c_noise}
    for name, value in expected.items():
        assert getattr(c, name).item() == pytest.approx(value, rel=1e-4, abs=1e-9), name
    assert pipe.loss_weight(s).item() == pytest.approx(weight, rel=1e-6)


def test_loss_weight_makes_the_network_target_unit_weighted():
    """lambda(sigma) c_out(sigma)^2 = 1 (EDM sec. 5): every sigma's F-target has unit weight."""
    pipe = EDMPipeline()
    sigma = torch.logspace(-3, 2, 50, dtype=torch.float64)
    torch.testing.assert_close(
        pipe.loss_weight(sigma) * pipe.preconditioning(sigma).c_out ** 2, torch.ones(50, dtype=torch.float64)
    )


def test_training_sigma_is_log_normal():
    pipe = EDMPipeline()
    ln_sigma = pipe.draw_sigma(20_000, torch.Generator().manual_seed(0)).log().double().numpy()
    p_value = stats.kstest(ln_sigma, "norm", args=(-1.2, 1.2)).pvalue
    assert p_value > 0.01, p_value


def test_training_noise_is_deterministic_given_generator():
    pipe = EDMPipeline()
    a = pipe.draw_training_noise(3, (10, 4), torch.Generator().manual_seed(5))
    b = pipe.draw_training_noise(3, (10, 4), torch.Generator().manual_seed(5))
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)
    assert a[0].shape == (10, 4) and a[1].shape == (3,)


def packed_example(seed: int = 0):
    """Two samples of 3 and 2 real tokens, padded to segments of 4 and 3: sample_ids, loss_mask, x0."""
    sample_ids = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    loss_mask = torch.tensor([1, 1, 1, 0, 1, 1, 0], dtype=torch.float32)
    x0 = torch.randn(7, 6, generator=torch.Generator().manual_seed(seed))
    return sample_ids, loss_mask, x0


def test_model_input_is_scaled_noisy_data():
    pipe = EDMPipeline()
    sample_ids, _, x0 = packed_example()
    noise = torch.randn_like(x0)
    sigma = torch.tensor([0.3, 7.0])
    x_in, c_noise = pipe.model_input(x0, noise, sigma, sample_ids)
    token_sigma = sigma[sample_ids][:, None]
    torch.testing.assert_close(x_in, (x0 + token_sigma * noise) / (token_sigma**2 + 0.25).sqrt())
    torch.testing.assert_close(c_noise, sigma.log() / 4)


def test_loss_is_weighted_denoising_error_and_zero_for_the_ideal_output():
    pipe = EDMPipeline()
    sample_ids, loss_mask, x0 = packed_example()
    noise = torch.randn_like(x0)
    sigma = torch.tensor([0.3, 7.0])
    c = pipe.preconditioning(sigma)
    x = x0 + sigma[sample_ids][:, None] * noise
    # Eq. 8: F's ideal output (x0 - c_skip x) / c_out makes D(x) = x0.
    ideal = (x0 - c.c_skip[sample_ids][:, None] * x) / c.c_out[sample_ids][:, None]
    assert pipe.training_loss(ideal, x0, noise, sigma, sample_ids, loss_mask).abs().max() < 1e-10
    # A zero output leaves D = c_skip x.
    zero_loss = pipe.training_loss(torch.zeros_like(x0), x0, noise, sigma, sample_ids, loss_mask)
    err = (c.c_skip[sample_ids][:, None] * x - x0) ** 2
    expected = torch.stack([err[:3].mean(), err[4:6].mean()]) * pipe.loss_weight(sigma)
    torch.testing.assert_close(zero_loss, expected)


def test_denoise_applies_the_preconditioning():
    pipe = EDMPipeline()
    sample_ids = torch.tensor([0, 0, 1])
    x = torch.randn(3, 2, generator=torch.Generator().manual_seed(1))
    seen = {}

    def net(x_in, c_noise):
        seen["x_in"], seen["c_noise"] = x_in, c_noise
        return 2 * x_in + 1

    sigma = torch.tensor([0.5, 3.0])
    out = pipe.denoise(net, x, sigma, sample_ids)
    c = pipe.preconditioning(sigma)

    def tok(v):
        return v[sample_ids][:, None]

    torch.testing.assert_close(seen["x_in"], tok(c.c_in) * x)
    torch.testing.assert_close(seen["c_noise"], sigma.log() / 4)
    torch.testing.assert_close(out, tok(c.c_skip) * x + tok(c.c_out) * (2 * tok(c.c_in) * x + 1))
    # A scalar level means the same sigma for every sample.
    torch.testing.assert_close(
        pipe.denoise(net, x, 0.5, sample_ids), pipe.denoise(net, x, torch.tensor([0.5, 0.5]), sample_ids)
    )


def test_karras_schedule():
    sigmas = karras_sigmas(18, 0.002, 80.0, 7.0)
    assert len(sigmas) == 19 and sigmas[-1] == 0.0
    assert sigmas[0] == pytest.approx(80.0) and sigmas[-2] == pytest.approx(0.002)
    assert all(a > b for a, b in itertools.pairwise(sigmas))
    # rho = 1 is a linear schedule.
    assert karras_sigmas(5, 1.0, 5.0, 1.0) == pytest.approx([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])


def test_loss_for_chains_the_pieces_deterministically_and_backpropagates():
    pipe = build_pipeline("edm")
    sample_ids, loss_mask, x0 = packed_example()
    layer = torch.nn.Linear(6, 6)

    def net(x_in, c_noise):
        return layer(x_in)

    loss_a = pipe.loss_for(net, x0, sample_ids, loss_mask, torch.Generator().manual_seed(3))
    loss_b = pipe.loss_for(net, x0, sample_ids, loss_mask, torch.Generator().manual_seed(3))
    torch.testing.assert_close(loss_a, loss_b)
    assert loss_a.shape == (2,)
    loss_a.mean().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------
# Packed per-sample loss (shared by both pipelines)
# ---------------------------------------------------------------------------------------------


def test_masked_mean_per_sample_by_hand():
    values = torch.tensor([[1.0, 3.0], [5.0, 7.0], [100.0, 100.0], [2.0, 2.0], [float("nan"), 0.0]])
    sample_ids = torch.tensor([0, 0, 0, 1, 1])
    loss_mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0])
    torch.testing.assert_close(masked_mean_per_sample(values, sample_ids, loss_mask, 3), torch.tensor([4.0, 2.0, 0.0]))


@pytest.mark.parametrize("name", ["edm", "flow"])
def test_per_sample_loss_ignores_padding_and_token_count(name):
    """A 1-token sample and a 100-token sample with the same per-token error get the same loss;
    padding tokens (loss_mask 0) change nothing, whatever the model outputs there."""
    pipe = build_pipeline(name)
    lengths, padded = [1, 100], [4, 104]
    sample_ids = torch.repeat_interleave(torch.arange(2), torch.tensor(padded))
    loss_mask = torch.cat([torch.arange(p) < n for n, p in zip(lengths, padded)]).float()
    x0 = torch.zeros(sum(padded), 3)
    noise = torch.zeros_like(x0)
    level = torch.tensor([0.5, 0.5])
    raw = torch.full_like(x0, 0.7)  # the same error on every real token
    loss = pipe.training_loss(raw, x0, noise, level, sample_ids, loss_mask)
    torch.testing.assert_close(loss[0], loss[1])
    assert loss[0] > 0
    garbage = torch.where(loss_mask[:, None] > 0, raw, torch.full_like(raw, 1e6))
    torch.testing.assert_close(pipe.training_loss(garbage, x0, noise, level, sample_ids, loss_mask), loss)


def test_settings_are_validated():
    with pytest.raises(ValueError, match="heun"):
        EDMSettings(sampler="dpm")
    with pytest.raises(ValueError):
        EDMSettings(sigma_min=100.0)
    assert math.isinf(EDMSettings().S_max)
