"""What one timed run measured, and the clock both sides share."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

import torch


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


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def start_clock(device: torch.device) -> float:
    """Drain queued device work first, so the window holds only the timed steps."""
    synchronize(device)
    return time.perf_counter()


def stop_clock(device: torch.device, start: float) -> float:
    synchronize(device)
    return time.perf_counter() - start


def reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
