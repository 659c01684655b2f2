"""Under Megatron-FSDP a DP rank gathers the student's weights in every student call, so all DP ranks must call
it equally often though each draws its own backward-simulation step for its pack (dfm/training/distill_step.py
``call_in_step``). Here in one process, with the peers' largest step index given: the calls, and that the sample
and the generator's later draws are those of the plain backward simulation."""

from __future__ import annotations

import torch

from dfm.diffusion import FlowPipeline, FlowSettings
from dfm.distill import DistillSettings, Packing, generate_student_sample
from dfm.distill.batch import Conditioning
from dfm.training.distill_step import STUDENT, DistillForwardStep, Players

PACKING = Packing(torch.tensor([0, 0, 1, 1, 1]), torch.ones(5), 2)


class CountingNet:
    """A student whose calls are counted: v = x / 2 + t per token."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x: torch.Tensor, c_noise: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x / 2 + (c_noise / 1000.0)[PACKING.sample_ids][:, None]


def test_every_rank_calls_the_student_as_often_as_the_largest_drawn_step_and_samples_as_before():
    pipe, settings = FlowPipeline(FlowSettings(c_noise_scale=1000.0)), DistillSettings()
    largest = len(settings.student_timesteps) - 1
    noise = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    drawn = set()
    for seed in range(12):
        plain_net, lockstep_net = CountingNet(), CountingNet()
        step = DistillForwardStep(STUDENT, pipe, settings, Players(lockstep_net, None, None), 0, torch.device("cpu"))
        assert step.common_index is None  # not FSDP-wrapped: no collective, no extra calls
        step.common_index = lambda index: largest  # a peer drew the last step
        plain_gen, lockstep_gen = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        plain = generate_student_sample(pipe, plain_net, noise, PACKING, settings, plain_gen, Conditioning())
        sample = step.student_sample(lockstep_net, noise, PACKING, lockstep_gen, Conditioning())
        drawn.add(plain.step_index)
        assert (plain_net.calls, lockstep_net.calls) == (plain.step_index + 1, largest + 1)
        assert sample.step_index == plain.step_index and torch.equal(sample.x0, plain.x0)
        assert torch.equal(torch.rand(4, generator=lockstep_gen), torch.rand(4, generator=plain_gen))
    assert len(drawn) > 1  # the seeds drew different steps
