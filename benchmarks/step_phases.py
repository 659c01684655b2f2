"""Where one training step goes, dfm and the reference side by side, on one rung.

    python -m benchmarks.step_phases --rung digits-video --steps 8 --out outputs/phases

Per phase, CPU milliseconds a step (``time.process_time`` around the trainer's own functions, one
thread, the two sides taking turns step by step: a shared machine's load falls on both alike); then,
over one more step of each side, the time inside aten ops (torch.profiler's self CPU time) against the
rest (Python, dispatch, autograd bookkeeping), the autograd nodes run, and the Python-level torch
calls made (a TorchFunctionMode count) with their top call sites.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile

import benchmarks.reference_runner as reference_runner
import dfm.training.forward_step as forward_step
import dfm.training.pretrain as pretrain
from benchmarks.dfm_runner import DfmSide
from benchmarks.ladders import get_ladder
from benchmarks.reference_runner import ReferenceSide
from benchmarks.run_benchmarks import rung_config, running_layout
from dfm.platform.distributed import destroy_distributed, initialize_distributed

# (label, owner, attribute): the functions whose CPU time makes a phase.
PHASES = {
    "dfm": [
        ("noise + batch to device", forward_step.DiffusionForwardStep, "prepare"),
        ("forward + loss", forward_step.DiffusionForwardStep, "run"),
        ("backward", "megatron.core.pipeline_parallel.schedules", "backward_step"),
        ("finite / preemption checks", pretrain, "step_checks"),
        ("optimizer (norm, clip, Adam)", "megatron.core.optimizer.optimizer", "ChainedOptimizer.step"),
    ],
    "reference": [
        ("noise + forward + loss", reference_runner, "batch_loss"),
        ("backward", torch.Tensor, "backward"),
        ("clip", torch.nn.utils, "clip_grad_norm_"),
        ("optimizer (Adam)", torch.optim.Adam, "step"),
    ],
}


def resolve(owner, attribute: str):
    """(object, name) the patch goes on: a module path or object, and a dotted attribute."""
    if isinstance(owner, str):
        owner = __import__(owner, fromlist=["_"])
    *path, name = attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name


@contextlib.contextmanager
def phase_clocks(totals: dict[str, float], running: dict[str, str]):
    """Adds each phase function's CPU seconds to ``totals[label]`` while inside, counted for the side
    ``running["side"]`` names only (both sides call torch's backward)."""
    patched = []
    for side, label, owner, attribute in [(side, *p) for side, phases in PHASES.items() for p in phases]:
        target, name = resolve(owner, attribute)
        original = getattr(target, name)

        def timed(*args, _original=original, _label=label, _side=side, **kwargs):
            if running.get("side") != _side:
                return _original(*args, **kwargs)
            start = time.process_time()
            try:
                return _original(*args, **kwargs)
            finally:
                totals[(_side, _label)] = totals.get((_side, _label), 0.0) + time.process_time() - start

        setattr(target, name, timed)
        patched.append((target, name, original))
    try:
        yield
    finally:
        for target, name, original in patched:
            setattr(target, name, original)


class CallCounter(TorchFunctionMode):
    """Python-level torch calls, by the innermost dfm / megatron / benchmarks frame that made them."""

    def __init__(self):
        super().__init__()
        self.sites: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        frames = [
            f
            for f in traceback.extract_stack()[:-1]
            if any(k in f.filename for k in ("dfm/", "megatron/", "benchmarks/"))
        ]
        site = (
            f"{frames[-1].filename.split('site-packages/')[-1].split('/work/main/')[-1]}:{frames[-1].lineno}"
            if frames
            else "other"
        )
        self.sites[site] += 1
        return func(*args, **(kwargs or {}))


def phase_table(phases: dict, side: str, step_s: float, steps: int) -> dict[str, float]:
    """Milliseconds a step per phase of ``side``, and the rest of its step (megatron's schedule and
    grad-buffer machinery, the loader wrapper, Python between the phases)."""
    table = {label: round(phases.get((side, label), 0.0) / steps * 1e3, 1) for label, *_ in PHASES[side]}
    table["rest"] = round(step_s / steps * 1e3 - sum(table.values()), 1)
    return table


def one_step_counts(side, index: int) -> dict:
    """The share of step ``index``'s wall time inside aten ops (the rest: Python, dispatch, autograd
    bookkeeping; both wall clocks, so a share, not milliseconds, holds under load), the autograd nodes
    run and the Python-level torch calls made (step ``index + 1``)."""
    prof = profile(activities=[ProfilerActivity.CPU])
    start = time.perf_counter()
    with prof:
        side.step(index)
    wall_us = (time.perf_counter() - start) * 1e6
    events = prof.key_averages()
    op_us = sum(e.self_cpu_time_total for e in events if e.key.startswith("aten::"))
    nodes = sum(e.count for e in events if e.key.startswith("autograd::engine::evaluate_function: "))
    counter = CallCounter()
    with counter:
        side.step(index + 1)
    return {
        "aten_op_share": round(op_us / wall_us, 3),
        "autograd_nodes": nodes,
        "torch_calls": sum(counter.sites.values()),
        "top_call_sites": counter.sites.most_common(8),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rung", required=True, help="a cpu-ladder rung (benchmarks/ladders.py)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default="outputs/phases")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # CPU seconds of one thread: comparable under another process's load
    rung = next(r for r in get_ladder("cpu") if r.name == args.rung)
    device = initialize_distributed(running_layout(rung_config(rung, [])))
    try:
        total = args.warmup + args.steps + 2
        sides = {
            "dfm": DfmSide(rung_config(rung, []), device, total),
            "reference": ReferenceSide(rung_config(rung, []), device, total),
        }
        for index in range(args.warmup):
            for side in sides.values():
                side.step(index)
        phases: dict[str, float] = {}
        steps, running = {label: 0.0 for label in sides}, {}
        with phase_clocks(phases, running):
            for index in range(args.warmup, args.warmup + args.steps):
                for label, side in sides.items():
                    running["side"] = label
                    start = time.process_time()
                    side.step(index)
                    steps[label] += time.process_time() - start
        result = {"rung": rung.name, "steps": args.steps, "sides": {}}
        for label, side in sides.items():
            result["sides"][label] = {
                "step_cpu_ms": round(steps[label] / args.steps * 1e3, 1),
                "phases_cpu_ms": phase_table(phases, label, steps[label], args.steps),
                **one_step_counts(side, args.warmup + args.steps),
            }
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{rung.name}.json").write_text(json.dumps(result, indent=2))
        print(json.dumps(result, indent=2))
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
