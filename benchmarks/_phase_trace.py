"""Per-phase peak RSS of one rank (``DFM_PHASE_TRACE=1`` under benchmarks/_peak_entry.py).

Wraps the trainer's phase functions (build, optimizer, forward-backward, step checks, optimizer step,
save); at every phase boundary records the current RSS and the peak RSS since the previous boundary
(Linux: ``VmHWM``, reset through ``/proc/self/clear_refs``). Since that reset also lowers the peak
``getrusage`` reports, the whole-run peak is then the largest phase peak (``overall_peak``).
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

PHASES: list[dict] = []


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def mark(name: str) -> None:
    """Close the phase ``name``: its peak, and the RSS it leaves."""
    record = {"phase": name, "peak": _status("VmHWM"), "rss": _status("VmRSS")}
    if os.environ.get("DFM_TRACE_TRIM"):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        record["trimmed"] = _status("VmRSS")
    PHASES.append(record)
    Path("/proc/self/clear_refs").write_text("5")


def overall_peak() -> int:
    return max([p["peak"] for p in PHASES] + [_status("VmHWM")])


def traced(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        mark(f"before {name}")
        result = fn(*args, **kwargs)
        mark(name)
        return result

    return wrapper


def install() -> None:
    """Wrap the phase functions where dfm.training.pretrain calls them."""
    import dfm.training.pretrain as pretrain

    pretrain.build_model = traced("build_model", pretrain.build_model)
    build_optimizer = pretrain.build_optimizer

    def optimizer_traced(*args, **kwargs):
        optimizer, scheduler = traced("build_optimizer", build_optimizer)(*args, **kwargs)
        optimizer.step = traced("optimizer.step", optimizer.step)
        return optimizer, scheduler

    pretrain.build_optimizer = optimizer_traced
    get_fb = pretrain.get_forward_backward_func
    pretrain.get_forward_backward_func = lambda: traced("forward_backward", get_fb())
    pretrain.step_checks = traced("step_checks", pretrain.step_checks)
    pretrain.save_checkpoint = traced("save_checkpoint", pretrain.save_checkpoint)
