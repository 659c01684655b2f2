"""Mock-data benchmark ladder: dfm against the plain-PyTorch reference, in one process, side by side.

    python -m benchmarks.run_benchmarks --ladder cpu --out outputs/bench
    torchrun --nproc-per-node 2 -m benchmarks.run_benchmarks --ladder cpu --only tiny-256-mix \\
        --set model.tensor_model_parallel_size=2
    python -m benchmarks.run_benchmarks --ladder gpu --out $OUT

Each rung times dfm (the trainer's own model/optimizer/forward-step/schedule) and the reference on
the same packs and device, drawn before the clock, and reports dfm/reference. On the CPU the two
sides take turns step by step, so a shared machine's load falls on both alike; on a GPU each side
runs alone (its own peak memory). Writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import sys
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `benchmarks` and `dfm` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.dfm_runner import DfmSide, time_dfm
from benchmarks.ladders import Rung, get_ladder
from benchmarks.reference_runner import ReferenceSide, time_reference
from benchmarks.report import markdown_table, mixed_vs_fixed, ratio, side_metrics
from benchmarks.timing import CLOCKS, time_sides
from benchmarks.variants import apply_variant
from dfm.config.loader import build_config
from dfm.parallel import ParallelLayout, launched_world_size
from dfm.platform.distributed import destroy_distributed, initialize_distributed
from dfm.training.throughput import device_peak_flops

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ladder", default="cpu", help="cpu | gpu-smoke | gpu (benchmarks/ladders.py)")
    parser.add_argument("--only", default="", help="comma-separated rung names to run (default: all)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (compilation, allocator warm-up)")
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps per side")
    parser.add_argument(
        "--repeat", type=int, default=1, help="run the chosen rungs this many times (rows 'NAME#2', ...)"
    )
    parser.add_argument(
        "--clock",
        default="wall",
        choices=sorted(CLOCKS),
        help="cpu: this process's CPU seconds (a machine shared with other jobs; pair with --threads 1)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides for every rung (e.g. the layout)")
    parser.add_argument("--no-reference", action="store_true", help="time dfm only")
    parser.add_argument("--out", default="outputs/benchmarks", help="folder for results.json / results.md")
    return parser.parse_args(argv)


def rung_config(rung: Rung, extra: list[str]):
    config_file = str(REPO / rung.config_file) if rung.config_file else None
    return build_config(rung.recipe, config_file, [*rung.overrides, *extra])


def running_layout(cfg) -> ParallelLayout:
    """The parallel layout of ``cfg`` on the ranks torchrun started."""
    return ParallelLayout.from_config(cfg.model, launched_world_size())


def timed_side(timer, cfg, device, args, steps: int, gpus_sharing: int, peak) -> dict:
    """Run one side; a failure (out of memory, say) becomes the row's entry, not the ladder's end."""
    try:
        return side_metrics(cfg, timer(cfg, device, args.warmup, steps, clock=CLOCKS[args.clock]), gpus_sharing, peak)
    except Exception as error:  # noqa: BLE001 - reported in the table, traceback on stderr
        return error_entry(error)
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


def error_entry(error: Exception) -> dict:
    traceback.print_exc()
    return {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}


def timed_together(rung: Rung, args, device, steps: int, gpus_sharing: int, peak) -> tuple[dict, dict]:
    """dfm and the reference built side by side, then stepped in turns (the CPU: shared cores' load
    falls on both alike; no per-side peak memory to keep apart there)."""
    cfgs = rung_config(rung, args.set), rung_config(rung, args.set)
    try:
        sides = [DfmSide(cfgs[0], device, args.warmup + steps), ReferenceSide(cfgs[1], device, args.warmup + steps)]
        dfm, reference = time_sides(sides, device, args.warmup, steps, clock=CLOCKS[args.clock])
    except Exception as error:  # noqa: BLE001 - reported in the table, traceback on stderr
        return error_entry(error), error_entry(error)
    return side_metrics(cfgs[0], dfm, gpus_sharing, peak), side_metrics(cfgs[1], reference, 1, peak)


def run_rung(rung: Rung, args, device, peak) -> dict:
    cfg = rung_config(rung, args.set)
    row = {"config": rung.name, "variant": rung.variant, "overrides": rung.overrides + args.set, "mix_of": rung.mix_of}
    row["timed_steps"] = steps = rung.timed_steps(args.steps)
    with_reference = rung.reference and not args.no_reference
    sharing = running_layout(cfg).model_parallel
    with apply_variant(rung.variant):  # variants patch dfm's model code, which the reference never calls
        if with_reference and device.type == "cpu":
            row["dfm"], row["reference"] = timed_together(rung, args, device, steps, sharing, peak)
        else:
            row["dfm"] = timed_side(time_dfm, cfg, device, args, steps, sharing, peak)
    if with_reference and "reference" not in row:
        # Every process runs its own copy on its own packs: a single-device reference, per GPU.
        row["reference"] = timed_side(time_reference, rung_config(rung, args.set), device, args, steps, 1, peak)
    row["ratio"] = ratio(row["dfm"], row.get("reference"))
    tokens = row["dfm"].get("tokens_per_sec_per_gpu"), row["dfm"].get("samples_per_sec_per_gpu")
    row["tokens_per_sample"] = round(tokens[0] / tokens[1]) if None not in tokens else None
    return row


def environment(device, argv, clock: str) -> dict:
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU ({platform.processor() or platform.machine()})"
    )
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": name,
        "world_size": torch.distributed.get_world_size(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_threads": torch.get_num_threads(),
        "clock": clock,
        "command": " ".join(["python -m benchmarks.run_benchmarks", *argv]),
    }


def write_results(out: Path, env: dict, rows: list[dict]) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=2))
    header = f"{env['date']} | {env['device']} x{env['world_size']} | torch {env['torch']}\n`{env['command']}`\n\n"
    table = header + markdown_table(rows) + "\n"
    (out / "results.md").write_text(table)
    return table


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    rungs = get_ladder(args.ladder)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.only:
        wanted = args.only.split(",")
        rungs = [r for r in rungs if r.name in wanted]
    if args.repeat > 1:  # a second pass after the first: the ratio's spread on a shared machine
        rungs = rungs + [dataclasses.replace(r, name=f"{r.name}#{k}") for k in range(2, args.repeat + 1) for r in rungs]
    # One process-group setup for the whole ladder: every rung shares the layout given in --set.
    device = initialize_distributed(running_layout(rung_config(rungs[0], args.set)))
    torch._dynamo.config.cache_size_limit = 64  # many shapes across rungs: keep compiled kernels
    try:
        peak, env, rows = device_peak_flops(device), environment(device, argv, args.clock), []
        for rung in rungs:
            rows.append(run_rung(rung, args, device, peak))
            for row in rows:  # a mixed rung's comparison completes once its fixed rungs ran
                if row["mix_of"]:
                    row["mixed_vs_fixed"] = mixed_vs_fixed(row, rows)
            if torch.distributed.get_rank() == 0:  # written after every rung: a cut-off run keeps its rows
                print(json.dumps(rows[-1]), flush=True)
                table = write_results(Path(args.out), env, rows)
        if torch.distributed.get_rank() == 0:
            print(table)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
