"""Measured per-rank peak memory of training, and of training with a save, against the rank's state.

    python -m benchmarks.memory_phases [--dp 2 4] [--kinds distributed_optimizer fsdp]

Each case runs the real entry point (pretrain_dit_model.py through benchmarks/_peak_entry.py) under
torchrun with ``--mock``: a 0.22B-parameter cross-attention DiT (24 x 640, packs of up to 256
tokens, every block recomputed in backward as conf/dit_28b_64k.yaml does), bf16, 2 iterations,
once without and once with a checkpoint saved at the last iteration. 24 blocks, not 12: under
Megatron-FSDP a rank holds two blocks gathered (weights, and their gradients until reduced), i.e.
2/L of the model whatever the DP, which at L = 12 is by itself over 0.35x the DP=4 state; the
28B recipe has L = 50. Every rank writes its peak
(RSS on CPU, ``torch.cuda.max_memory_allocated`` on CUDA) at exit. "state" is the largest rank's
parameters + gradients + optimizer bytes as the start-up log measures them. Printed per case:

    DP=N KIND: train peak X.XXx state, save adds xY.YY

(the largest rank's peak over its state; the peak with a save over the peak without), then the FSDP
DP=4 / DP=2 ratio of the per-rank training peaks. 33 minutes on the 2-core machine under heavy load
(2026-11-25; not timed on a quiet one).

What is subtracted on CPU (printed too): the runtime every rank pays whatever the model size, measured
per case as the lowest rank's peak RSS of the same entry point, layout and 2 iterations with a
near-zero model (``NEAR_ZERO``: 2 x 64, ~0.2M parameters, state < 4 MB, which is included). It is the
import of exactly what the entry point imports (``import_baseline``, 0.39 GiB) plus ~0.1 GiB: the
process group (gloo's threads), the first use of torch's CPU kernels, the data loader. Everything above
it grows with the model: the state, activations, FSDP's gathered blocks, transient copies, and what
glibc's malloc keeps of freed tensors (small since dfm fixes its mmap threshold on CPU hosts,
dfm/platform/host_memory.py). ``DFM_PHASE_TRACE=1`` adds every rank's per-phase peaks to its record
(benchmarks/_phase_trace.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from dfm.training.memory import STATE_LOG_KEY

ROOT = Path(__file__).resolve().parents[1]
PEAK_ENTRY = Path(__file__).resolve().parent / "_peak_entry.py"
TINY_YAML = ROOT / "examples" / "megatron" / "recipes" / "dit" / "conf" / "dit_tiny.yaml"
KINDS = {
    "distributed_optimizer": ["ddp.use_distributed_optimizer=true"],
    "fsdp": ["ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params"],
}
# ~0.22B parameters: 24 blocks of 22 h^2 (self- and cross-attention, MLP, adaLN) at h = 640.
MODEL = [
    "model.hidden_size=640",
    "model.num_attention_heads=10",
    "model.num_layers=24",
    "model.text_embed_dim=64",
    # Every block recomputed in backward, as conf/dit_28b_64k.yaml: activations are then the blocks'
    # inputs plus one block's, not every block's (they do not shrink with DP, the state does).
    "model.recompute_granularity=full",
    "model.recompute_method=uniform",
    "model.recompute_num_layers=1",
    "mixed_precision.precision=bf16",
    "model.attention_backend=sdpa",
    "dataset.num_workers=0",
]
# A near-zero model of the same family: the per-case runtime baseline.
NEAR_ZERO = [
    *(o for o in MODEL if not o.startswith(("model.hidden_size", "model.num_attention_heads", "model.num_layers"))),
    "model.hidden_size=64",
    "model.num_attention_heads=2",
    "model.num_layers=2",
]
# What pretrain_dit_model.py (run by _peak_entry.py) imports before it builds anything.
IMPORT_ONLY = (
    "import atexit, json, resource, runpy, dfm.config.cli, dfm.training.pretrain;"
    " print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
)


@dataclass(frozen=True)
class Peaks:
    """One run: every rank's peak bytes (import baseline already subtracted) and state bytes."""

    peaks: dict[int, int]
    states: list[int]
    phases: dict[int, list[dict]] = field(default_factory=dict)  # with DFM_PHASE_TRACE: per rank

    @property
    def largest_rank(self) -> int:
        return max(self.peaks, key=self.peaks.get)

    def peak_over_state(self) -> float:
        return self.peaks[self.largest_rank] / self.states[self.largest_rank]


def import_baseline() -> int:
    """Peak RSS of a process that only imports the trainer (what every rank pays before any model)."""
    out = subprocess.run([sys.executable, "-c", IMPORT_ONLY], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def runtime_baseline(nproc: int, kind: str) -> int:
    """The lowest rank's peak RSS of the same case (no save) with the ``NEAR_ZERO`` model: what a rank
    pays at any model size (imports, process group, kernels, loader)."""
    with tempfile.TemporaryDirectory() as tmp:
        _, records = run_case(nproc, case_overrides(nproc, kind, None, NEAR_ZERO, Path(tmp) / "logs"))
    return min(r["peak_rss"] for r in records)


def case_overrides(dp: int, kind: str, save_dir: Path | None, model: list[str], log_dir: Path) -> list[str]:
    save = [f"checkpoint.save={save_dir}", "checkpoint.save_interval=2"] if save_dir else []
    steps = ["train.train_iters=2", f"train.global_batch_size={dp}"]  # one pack per rank per step
    return [*model, *KINDS[kind], *steps, f"logger.log_dir={log_dir}", *save]


def run_case(nproc: int, overrides: list[str], config: Path = TINY_YAML, timeout: int = 600) -> tuple[str, list[dict]]:
    """Run the entry point; (its log, the ranks' peak records)."""
    with tempfile.TemporaryDirectory() as tmp:
        peak_file = Path(tmp) / "peaks.jsonl"
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
        command = [*launcher, str(PEAK_ENTRY), "--config-file", str(config), "--mock", *overrides]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "DFM_PEAK_FILE": str(peak_file)}
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
        if result.returncode != 0:
            raise RuntimeError(f"case {overrides} failed:\n{result.stderr[-4000:]}")
        records = [json.loads(line) for line in peak_file.read_text().splitlines()]
    return result.stdout + result.stderr, records


def parse_states(log: str) -> list[int]:
    """Every rank's state bytes from the start-up log's ``state bytes per rank: [...]`` line."""
    for line in log.splitlines():
        if STATE_LOG_KEY in line:
            return json.loads(line.split(STATE_LOG_KEY, 1)[1])
    raise ValueError(f"no {STATE_LOG_KEY!r} line in the run's log")


def peaks_of(records: list[dict], baseline: int) -> dict[int, int]:
    """Per-rank peak: CUDA's max allocated where a rank used CUDA, else peak RSS minus the import baseline."""
    return {r["rank"]: r["cuda_peak"] if r["cuda_peak"] else r["peak_rss"] - baseline for r in records}


def measure(nproc: int, kind: str, save: bool, baseline: int, model: list[str] = MODEL) -> Peaks:
    with tempfile.TemporaryDirectory() as tmp:
        save_dir = Path(tmp) / "ckpt" if save else None
        log, records = run_case(nproc, case_overrides(nproc, kind, save_dir, model, Path(tmp) / "logs"))
    phases = {r["rank"]: r["phases"] for r in records if "phases" in r}
    return Peaks(peaks_of(records, baseline), parse_states(log), phases)


def case_line(dp: int, kind: str, train: Peaks, with_save: Peaks) -> str:
    save_ratio = with_save.peaks[with_save.largest_rank] / train.peaks[train.largest_rank]
    return f"DP={dp} {kind}: train peak {train.peak_over_state():.2f}x state, save adds x{save_ratio:.2f}"


def case_record(dp: int, kind: str, baseline: int, train: Peaks, with_save: Peaks) -> dict:
    """One case for ``--json``: bytes per rank (baseline subtracted), the printed line, and the largest
    rank's per-phase peaks (raw RSS, baseline not subtracted) where they were recorded."""
    rank = train.largest_rank
    return {
        "dp": dp,
        "kind": kind,
        "line": case_line(dp, kind, train, with_save),
        "subtracted_baseline": baseline,
        "state": train.states,
        "train_peak": train.peaks,
        "save_peak": with_save.peaks,
        "train_phases_largest_rank": train.phases.get(rank),
        "save_phases_largest_rank": with_save.phases.get(with_save.largest_rank),
    }


def fsdp_ratio_line(by_dp: dict[int, Peaks]) -> str:
    small, large = min(by_dp), max(by_dp)
    ratio = by_dp[large].peaks[by_dp[large].largest_rank] / by_dp[small].peaks[by_dp[small].largest_rank]
    return f"fsdp per-rank train peak DP={large} / DP={small}: {ratio:.2f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--kinds", nargs="+", choices=list(KINDS), default=["fsdp", "distributed_optimizer"])
    parser.add_argument("--json", type=Path, help="also write the figures (and per-phase peaks) here")
    parser.add_argument("--phases", action="store_true", help="record per-phase peaks (DFM_PHASE_TRACE)")
    args = parser.parse_args(argv)
    if args.phases:
        os.environ["DFM_PHASE_TRACE"] = "1"
    imports = import_baseline()
    print(f"import-only process: {imports / 2**30:.2f} GiB RSS", flush=True)
    fsdp_train, report = {}, {"import_only": imports, "cases": []}
    for kind in args.kinds:
        for dp in args.dp:
            try:
                baseline = runtime_baseline(dp, kind)
                print(f"  DP={dp} {kind}: near-zero model's peak (subtracted) {baseline / 2**30:.2f} GiB", flush=True)
                train, with_save = (measure(dp, kind, save, baseline) for save in (False, True))
            except (RuntimeError, subprocess.TimeoutExpired) as failure:  # e.g. a rank killed out of memory
                print(f"DP={dp} {kind}: failed: {str(failure).splitlines()[0][:200]}", flush=True)
                continue
            state = train.states[train.largest_rank]
            peak = train.peaks[train.largest_rank]
            print(f"  DP={dp} {kind}: state {state / 2**30:.2f} GiB, train peak {peak / 2**30:.2f} GiB", flush=True)
            print(case_line(dp, kind, train, with_save), flush=True)
            report["cases"].append(case_record(dp, kind, baseline, train, with_save))
            if kind == "fsdp":
                fsdp_train[dp] = train
    if len(fsdp_train) > 1:
        print(fsdp_ratio_line(fsdp_train))
        report["fsdp_ratio_line"] = fsdp_ratio_line(fsdp_train)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
