"""What one timed run measured, the clock both sides share, and the loop that times them.

A side (dfm's trainer, the reference) is built with its packs drawn, then stepped: alone (each side's
peak memory its own; GPUs), or alternating step by step with the other side (``time_sides``), so load
from other processes on a shared CPU falls on both sides alike.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from dfm.platform.frozen_heap import setup_objects_frozen


@dataclass
class Timing:
    """``steps`` optimizer steps after warm-up; lengths are per sample, over all timed steps."""

    elapsed_s: float
    steps: int
    video_lens: list[int] = field(default_factory=list)
    text_lens: list[int] = field(default_factory=list)
    peak_mem_gib: float | None = None

    @property
    def step_time_s(self) -> float:
        return self.elapsed_s / self.steps


def draw_packs(loader, steps: int, n_micro: int) -> list[list]:
    """``steps`` optimizer steps' micro-batches, drawn before the clock starts: both sides time the
    training step on the same packs, not the loader (real runs load in worker processes;
    benchmarks/bench_dataloader.py times the loader)."""
    return [[next(loader) for _ in range(n_micro)] for _ in range(steps)]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


CLOCKS = {
    "wall": time.perf_counter,
    # This process's CPU seconds: on a CPU shared with other jobs, the work done rather than the wait
    # for a core (run with one torch thread, or a thread's spinning counts too).
    "cpu": time.process_time,
}


def start_clock(device: torch.device, clock=time.perf_counter) -> float:
    """Drain queued device work first, so the window holds only the timed steps."""
    synchronize(device)
    return clock()


def stop_clock(device: torch.device, start: float, clock=time.perf_counter) -> float:
    synchronize(device)
    return clock() - start


def reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


class Side(Protocol):
    packs: list[list]  # each step's micro-batches (PackedBatch), drawn before any step

    def step(self, index: int) -> None:
        """Optimizer step ``index`` (0-based) over ``packs[index]``."""


def sample_lengths(packs: list) -> tuple[list[int], list[int]]:
    """(video, text) tokens of each sample of ``packs``."""
    return [n for p in packs for n in p.host_sample_lengths()], [n for p in packs for n in p.host_text_lengths()]


def time_sides(
    sides: list[Side], device, warmup: int, steps: int, profiler=None, clock=time.perf_counter
) -> list[Timing]:
    """``warmup`` untimed steps of each side, then ``steps`` timed ones, the sides taking turns by step;
    ``profiler`` (a torch.profiler.profile) records the timed steps only; ``clock``: one of CLOCKS."""
    with setup_objects_frozen():  # as dfm's training loop runs its steps (dfm/platform/frozen_heap.py)
        elapsed = step_in_turns(sides, device, warmup, steps, profiler, clock)
    timings = []
    for seconds, side in zip(elapsed, sides):
        timed = [pack for step in side.packs[warmup : warmup + steps] for pack in step]
        timings.append(Timing(seconds, steps, *sample_lengths(timed), peak_memory_gib(device)))
    return timings


def step_in_turns(sides: list[Side], device, warmup: int, steps: int, profiler, clock) -> list[float]:
    """``time_sides``' steps -> each side's seconds over its timed steps."""
    for index in range(warmup):
        for side in sides:
            side.step(index)
    elapsed = [0.0] * len(sides)
    if profiler is not None:
        profiler.start()
    for index in range(warmup, warmup + steps):
        for k, side in enumerate(sides):
            start = start_clock(device, clock)
            side.step(index)
            elapsed[k] += stop_clock(device, start, clock)
    if profiler is not None:
        profiler.stop()
    return elapsed
