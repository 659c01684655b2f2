"""FLUX's training times: logit-normal t with the resolution-dependent shift of each sample."""

from __future__ import annotations

import math

import pytest
import torch

from dfm.diffusion.flow import FlowPipeline, FlowSettings
from dfm.diffusion.samplers import shift_timesteps


@pytest.mark.parametrize("tokens,log_shift", [(256, 0.5), (4096, 1.15), (1024, 0.5 + 0.65 * 768 / 3840)])
def test_dynamic_shift_follows_the_sample_token_count(tokens, log_shift):
    def draw(settings):
        return FlowPipeline(settings).draw_training_noise(1, (tokens, 4), torch.Generator().manual_seed(7))

    noise, t = draw(FlowSettings(dynamic_shift=True, shift=3.0))  # the fixed shift is not used
    base_noise, base_t = draw(FlowSettings())
    assert torch.equal(noise, base_noise)
    torch.testing.assert_close(t, shift_timesteps(base_t, math.exp(log_shift)))
