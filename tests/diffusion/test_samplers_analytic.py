"""Samplers against exact answers: Gaussian data x0 ~ N(mu, Sigma) has a closed-form optimal
denoiser (EDM) and velocity field (flow), and the probability-flow ODE maps noise to data by a
known affine map. The nets below go through the pipelines' preconditioning, so these tests also
check that denoise()/velocity() invert it correctly.
"""

from __future__ import annotations

import pytest
import torch

from dfm.diffusion import SamplingOptions, build_pipeline

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/diffusion/conftest.py


MU = torch.tensor([1.0, -0.5], dtype=torch.float64)
SIGMA = torch.tensor([[1.0, 0.6], [0.6, 0.5]], dtype=torch.float64)  # correlation 0.85
EIGVALS, EIGVECS = torch.linalg.eigh(SIGMA)
NUM_SAMPLES = 20_000
# Sampling error alone: std of the mean <= sqrt(1/20k) = 0.007, of a covariance entry <= 0.01.
MEAN_TOL = 0.03
COV_TOL = 0.05


def matrix_power(eig_fn) -> torch.Tensor:
    """U f(Lambda) U^T for Sigma = U Lambda U^T."""
    return EIGVECS @ torch.diag(eig_fn(EIGVALS)) @ EIGVECS.T


def optimal_denoiser(x: torch.Tensor, sigma: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """D*(x; sigma) = mu + Sigma (Sigma + sigma^2 I)^-1 (x - mu); x [S, 2], sigma [S]."""
    y = (x - mean) @ EIGVECS  # eigenbasis, where the matrix is diagonal
    gain = EIGVALS / (EIGVALS + sigma[:, None] ** 2)
    return mean + (y * gain) @ EIGVECS.T


def optimal_velocity(x: torch.Tensor, t: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """E[n - x0 | x_t = x] for x_t = (1 - t) x0 + t n; x [S, 2], t [S].

    With m = (1 - t) mu and C = (1 - t)^2 Sigma + t^2 I (the marginal of x_t):
    v = t C^-1 (x - m) - mu - (1 - t) Sigma C^-1 (x - m).
    """
    t = t[:, None]
    y = (x - (1 - t) * mean) @ EIGVECS
    c_inv_y = y / ((1 - t) ** 2 * EIGVALS + t**2)
    return (t * c_inv_y - (1 - t) * EIGVALS * c_inv_y) @ EIGVECS.T - mean


def edm_net(pipe):
    """Raw network F that makes the preconditioned D(x; sigma) equal D*: F = (D* - c_skip x) / c_out."""

    def net(x_in: torch.Tensor, c_noise: torch.Tensor, mean: torch.Tensor = MU) -> torch.Tensor:
        sigma = (4 * c_noise).exp()  # c_noise = ln(sigma) / 4; one token per sample here
        c = pipe.preconditioning(sigma)
        x = x_in / c.c_in[:, None]
        return (optimal_denoiser(x, sigma, mean) - c.c_skip[:, None] * x) / c.c_out[:, None]

    return net


def flow_net(pipe):
    def net(x_t: torch.Tensor, c_noise: torch.Tensor, mean: torch.Tensor = MU) -> torch.Tensor:
        return optimal_velocity(x_t, c_noise / pipe.settings.c_noise_scale, mean)

    return net


def standard_noise(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 2, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def edm_exact_endpoint(noise: torch.Tensor, sigma_max: float, mean: torch.Tensor = MU) -> torch.Tensor:
    """Exact PF-ODE solution from x(sigma_max) = sigma_max n: per eigen-direction x - mu scales as
    sqrt(lambda + sigma^2), so x(0) = mu + Sigma^1/2 (Sigma + sigma_max^2 I)^-1/2 (x(sigma_max) - mu)."""
    gain = matrix_power(lambda lam: (lam / (lam + sigma_max**2)).sqrt())
    return mean + (sigma_max * noise - mean) @ gain.T


def flow_exact_endpoint(noise: torch.Tensor, mean: torch.Tensor = MU) -> torch.Tensor:
    """Exact flow ODE solution from x(1) = n: x(0) = mu + Sigma^1/2 n (per eigen-direction, monotone affine)."""
    return mean + noise @ matrix_power(torch.sqrt).T


def assert_matches_data(samples: torch.Tensor, mean: torch.Tensor = MU) -> None:
    mean_err = (samples.mean(0) - mean).abs().max().item()
    cov_err = (torch.cov(samples.T) - SIGMA).abs().max().item()
    assert mean_err < MEAN_TOL, f"mean off by {mean_err:.4f}"
    assert cov_err < COV_TOL, f"covariance off by {cov_err:.4f}"


# ---------------------------------------------------------------------------------------------
# Distribution of the samples
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, settings, sampler, steps",
    [
        ("edm", {}, "heun", 40),
        # Churn is only asymptotically unbiased: at 40 steps S_churn=20 inflates the variance by ~5%.
        ("edm", {"S_churn": 10.0, "S_min": 0.05, "S_max": 50.0}, "heun", 80),
        ("flow", {}, "euler", 200),
        ("flow", {"shift": 3.0}, "heun", 32),
        ("flow", {"c_noise_scale": 1000.0}, "heun", 32),
    ],
)
def test_sampler_reproduces_gaussian_data(name, settings, sampler, steps):
    pipe = build_pipeline(name, **settings)
    net = edm_net(pipe) if name == "edm" else flow_net(pipe)
    samples = pipe.sample(
        net,
        standard_noise(NUM_SAMPLES),
        torch.arange(NUM_SAMPLES),
        SamplingOptions(steps, sampler=sampler, seed=2),
    )
    assert_matches_data(samples)


# ---------------------------------------------------------------------------------------------
# Each trajectory against the exact ODE solution, and the solvers' order of convergence
# ---------------------------------------------------------------------------------------------


def mean_path_error(name: str, sampler: str, steps: int, n: int = 2000) -> float:
    pipe = build_pipeline(name)
    noise = standard_noise(n, seed=3)
    if name == "edm":
        samples = pipe.sample(edm_net(pipe), noise, torch.arange(n), SamplingOptions(steps, sampler=sampler))
        exact = edm_exact_endpoint(noise, pipe.settings.sigma_max)
    else:
        samples = pipe.sample(flow_net(pipe), noise, torch.arange(n), SamplingOptions(steps, sampler=sampler))
        exact = flow_exact_endpoint(noise)
    return (samples - exact).norm(dim=1).mean().item()


@pytest.mark.parametrize(
    "name, sampler, steps, tol",
    [("edm", "heun", 64, 5e-3), ("flow", "heun", 32, 1e-3), ("flow", "euler", 200, 2e-2)],
)
def test_trajectories_match_exact_ode_solution(name, sampler, steps, tol):
    assert mean_path_error(name, sampler, steps) < tol


@pytest.mark.parametrize(
    "name, sampler, expected_order",
    [("edm", "heun", 2), ("edm", "euler", 1), ("flow", "heun", 2), ("flow", "euler", 1)],
)
def test_solver_order_of_convergence(name, sampler, expected_order):
    """Doubling the steps divides the error by ~2^order: the solver is the one it claims to be."""
    coarse, fine = mean_path_error(name, sampler, 32), mean_path_error(name, sampler, 64)
    measured_order = torch.log2(torch.tensor(coarse / fine)).item()
    assert abs(measured_order - expected_order) < 0.35, f"order {measured_order:.2f}"


# ---------------------------------------------------------------------------------------------
# Classifier-free guidance
# ---------------------------------------------------------------------------------------------

MU_UNCOND = torch.tensor([-1.0, 1.0], dtype=torch.float64)


@pytest.mark.parametrize("name, sampler", [("edm", "heun"), ("flow", "euler"), ("flow", "heun")])
@pytest.mark.parametrize("scale", [1.0, 0.0, 2.5])
def test_guidance_equals_sampling_the_guided_gaussian(name, sampler, scale):
    """D* and v* are affine in mu, so guiding N(mu_c, Sigma) against N(mu_u, Sigma) with scale s is
    exactly sampling N(mu_u + s (mu_c - mu_u), Sigma): s = 1 is the conditional sample, s = 0 the
    unconditional one, s = 2.5 an extrapolated mean."""
    pipe = build_pipeline(name)
    net = edm_net(pipe) if name == "edm" else flow_net(pipe)
    n, steps = 500, 16
    noise, ids = standard_noise(n, seed=4), torch.arange(n)
    options = SamplingOptions(steps, guidance_scale=scale, sampler=sampler)
    guided = pipe.sample(net, noise, ids, options, cond={"mean": MU}, uncond={"mean": MU_UNCOND})
    guided_mean = MU_UNCOND + scale * (MU - MU_UNCOND)
    reference = pipe.sample(net, noise, ids, SamplingOptions(steps, sampler=sampler), cond={"mean": guided_mean})
    torch.testing.assert_close(guided, reference, atol=1e-9, rtol=1e-9)


def test_sampling_from_a_shape_is_deterministic_given_generator():
    pipe = build_pipeline("flow")
    ids = torch.arange(64)
    a = pipe.sample(flow_net(pipe), (64, 2), ids, SamplingOptions(4, seed=7))
    b = pipe.sample(flow_net(pipe), (64, 2), ids, SamplingOptions(4, seed=7))
    torch.testing.assert_close(a, b)
