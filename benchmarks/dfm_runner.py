"""Time dfm's training step through the trainer's own pieces.

Model, optimizer, forward step, loader and ``train_step`` are the ones ``dfm.training.pretrain``
uses, so a figure here is the trainer's speed minus its logging.
"""

from __future__ import annotations

import torch

from benchmarks.timing import Timing, peak_memory_gib, reset_memory, start_clock, stop_clock
from dfm.checkpoint.state import TrainingState
from dfm.diffusion.pipeline import pipeline_from_config
from dfm.parallel import ParallelLayout
from dfm.training.data import build_mock_loader
from dfm.training.forward_step import DiffusionForwardStep
from dfm.training.pretrain import RecordingIterator, finalize_defaults, train_step
from dfm.training.setup import build_model, build_optimizer, num_microbatches


def time_dfm(cfg, device: torch.device, warmup: int, steps: int, profiler=None) -> Timing:
    """``profiler`` (a torch.profiler.profile) records the timed steps only."""
    reset_memory(device)
    layout = ParallelLayout.from_config(cfg.model, torch.distributed.get_world_size())
    finalize_defaults(cfg, layout)
    model, tconfig = build_model(cfg, layout, device)
    optimizer, scheduler = build_optimizer(cfg, model, tconfig)
    pipeline = pipeline_from_config(cfg)
    forward_step = DiffusionForwardStep(pipeline, cfg.rng.seed, cfg.dataset.cfg_dropout_prob, device)
    data = RecordingIterator(build_mock_loader(cfg, layout))
    state = TrainingState(model, optimizer, scheduler, data)
    n_micro = num_microbatches(cfg, layout)
    for chunk in model:
        chunk.train()
    start = 0.0
    for iteration in range(1, warmup + steps + 1):
        if iteration == warmup + 1:
            start = start_clock(device)
            data.take()
            if profiler is not None:
                profiler.start()
        forward_step.iteration = iteration
        train_step(forward_step, state, n_micro, device)
    elapsed = stop_clock(device, start)
    if profiler is not None:
        profiler.stop()
    packs = data.take()
    return Timing(
        elapsed_s=elapsed,
        steps=steps,
        video_lens=[n for q, *_ in packs for n in q],
        text_lens=[n for _, kv, *_ in packs for n in kv],
        peak_mem_gib=peak_memory_gib(device),
    )
