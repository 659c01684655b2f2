"""Flow matching as Wan trains: dfm's velocity target and time are Wan's (v = noise - x0, x_t =
(1 - t) x0 + t noise, timestep 1000 t), and flow.training_mode picks the training distribution of t."""

import pytest
import torch

from dfm.config.errors import ConfigError
from dfm.config.loader import apply_overrides
from dfm.config.recipes import get_recipe
from dfm.config.validate import validate_config
from dfm.diffusion.flow import FlowPipeline, FlowSettings
from dfm.diffusion.registry import build_pipeline


def test_velocity_and_timestep_follow_wan():
    flow = FlowPipeline(FlowSettings(c_noise_scale=1000.0))
    x0, noise, t = torch.randn(6, 4), torch.randn(6, 4), torch.tensor([0.25, 0.75])
    ids = torch.tensor([0, 0, 0, 1, 1, 1])
    x_t, c_noise = flow.model_input(x0, noise, t, ids)
    assert torch.allclose(x_t, (1 - t[ids, None]) * x0 + t[ids, None] * noise)
    assert torch.equal(flow.target_velocity(x0, noise), noise - x0)
    assert torch.equal(c_noise, 1000 * t)


def draws(mode: str | None, shift: float) -> torch.Tensor:
    """20000 training draws of t after the shift (``mode`` None: FlowSettings' defaults)."""
    flow = build_pipeline("flow", shift=shift, **({"training_mode": mode} if mode else {}))
    return flow.draw_t(20000, torch.Generator().manual_seed(0))


def low_noise_share(mode: str, shift: float) -> float:
    """Fraction of training draws below t = 0.2 after the shift."""
    return (draws(mode, shift) < 0.2).float().mean().item()


@pytest.mark.parametrize("shift", [1.0, 5.0])
def test_finetune_mode_draws_more_low_noise_levels_than_pretrain(shift):
    assert low_noise_share("finetune", shift) > 2 * low_noise_share("pretrain", shift)


def test_shift_5_sends_about_a_third_to_the_high_noise_expert():
    """README: flow.shift=5 (Wan's) sends about a third of the training samples to Wan2.2-A14B's high-noise
    expert (t >= 0.875) with the default logit-normal(0, 1) draws: 0.364 here (0.028 at shift 1; uniform
    draws, flow.training_mode=finetune, send 0.42). Mutation checked: shift 1 fails it."""
    assert 0.3 <= (draws(None, 5.0) >= 0.875).float().mean().item() <= 0.4


def test_training_mode_sets_its_fields_and_refuses_a_contradiction():
    assert FlowSettings(training_mode="finetune").timestep_sampling == "uniform"
    assert FlowSettings(training_mode="pretrain", logit_std=1.0).timestep_sampling == "logit_normal"
    with pytest.raises(ValueError, match="flow.training_mode=pretrain sets flow.logit_std"):
        FlowSettings(training_mode="pretrain", logit_std=1.5)
    with pytest.raises(ValueError, match="unknown flow.training_mode 'warmup'"):
        FlowSettings(training_mode="warmup")


def test_a_contradicting_training_mode_fails_config_validation():
    cfg = get_recipe("Wan2.1-T2V-1.3B")
    apply_overrides(cfg, ["flow.training_mode=finetune", "flow.timestep_sampling=logit_normal"])
    validate_config(cfg)  # logit_normal is the default: the mode replaces it
    apply_overrides(cfg, ["flow.logit_std=2.0", "flow.training_mode=pretrain"])
    with pytest.raises(ConfigError, match="flow.training_mode=pretrain sets flow.logit_std"):
        validate_config(cfg)
