"""dfm's training step through the trainer's own pieces, as a benchmark side.

Model, optimizer, forward step and ``train_step`` are the ones ``dfm.training.pretrain`` uses, fed
the mock loader's packs drawn beforehand, so a figure here is the trainer's step minus its logging
and its loader.
"""

from __future__ import annotations

import time

import torch

from benchmarks.timing import Timing, draw_packs, reset_memory, time_sides
from dfm.checkpoint.state import TrainingState
from dfm.diffusion.registry import pipeline_from_config
from dfm.parallel import ParallelLayout
from dfm.training.data import build_mock_loader
from dfm.training.forward_step import DiffusionForwardStep
from dfm.training.pretrain import RecordingIterator, finalize_defaults, train_step
from dfm.training.setup import build_model, build_optimizer, num_microbatches


class DfmSide:
    """dfm's model, optimizer and forward step over ``total_steps`` steps' packs."""

    def __init__(self, cfg, device: torch.device, total_steps: int):
        layout = ParallelLayout.from_config(cfg.model, torch.distributed.get_world_size())
        finalize_defaults(cfg, layout)
        model, tconfig = build_model(cfg, layout, device)
        optimizer, scheduler = build_optimizer(cfg, model, tconfig)
        self.forward_step = DiffusionForwardStep(
            pipeline_from_config(cfg), cfg.rng.seed, cfg.dataset.cfg_dropout_prob, device
        )
        self.n_micro = num_microbatches(cfg, layout)
        self.packs = draw_packs(build_mock_loader(cfg, layout), total_steps, self.n_micro)
        self.state = TrainingState(model, optimizer, scheduler, None)
        self.device = device
        for chunk in model:
            chunk.train()

    def step(self, index: int) -> None:
        self.state.loader = RecordingIterator(iter(self.packs[index]))  # as the trainer wraps its loader
        self.forward_step.iteration = index + 1
        train_step(self.forward_step, self.state, self.n_micro, self.device)


def time_dfm(cfg, device: torch.device, warmup: int, steps: int, profiler=None, clock=time.perf_counter) -> Timing:
    """dfm alone; ``profiler`` (a torch.profiler.profile) records the timed steps only."""
    reset_memory(device)
    return time_sides([DfmSide(cfg, device, warmup + steps)], device, warmup, steps, profiler, clock)[0]
