"""Kernel-time breakdown of one rung's timed steps, dfm and reference: where the gap is.

python -m benchmarks.profile_rung --ladder gpu --rung h4096-8k-L6 --out $OUT/profile
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.dfm_runner import time_dfm
from benchmarks.ladders import get_ladder
from benchmarks.reference_runner import time_reference
from benchmarks.run_benchmarks import rung_config, running_layout
from benchmarks.variants import apply_variant
from dfm.platform.distributed import destroy_distributed, initialize_distributed


def kernel_table(prof, rows: int) -> str:
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=90)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ladder", default="cpu")
    parser.add_argument("--rung", required=True)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--out", default="outputs/profile")
    args = parser.parse_args(argv)
    rung = next(r for r in get_ladder(args.ladder) if r.name == args.rung)
    device = initialize_distributed(running_layout(rung_config(rung, [])))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    try:
        for side, timer in (("dfm", time_dfm), ("reference", time_reference)):
            prof = profile(activities=activities)
            with apply_variant(rung.variant if side == "dfm" else "default"):
                timing = timer(rung_config(rung, []), device, args.warmup, args.steps, profiler=prof)
            table = f"{side}: {timing.step_time_s:.3f} s/step\n{kernel_table(prof, args.rows)}"
            (out / f"{args.rung}-{side}.txt").write_text(table)
            print(table, flush=True)
            del prof
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
