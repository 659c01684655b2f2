"""The whole "it learns" path as three calls, shared by the CI test and the longer demo:

    dataset_dir = prepare_digits(root)                                   # image folder -> energon shards
    ckpt = train_digits(dataset_dir, root / "edm", CONF, ["model.pipeline=edm"])   # the real entry point
    scores = score_digits([ckpt], root, DigitSampling(), root / "edm/scores.json")

Training and scoring run as child processes (the real scripts, each with its own torch.distributed),
so a caller never holds process groups. Children run in the recipe folder, so ``python -m digits.evaluate``
finds this package.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from digits.clips import ClipSpec, prepare_clips_dataset, write_clip_vae
from digits.data import build_digit_text_encoder, prepare_digits_dataset, write_digit_vae
from digits.evaluate import DigitSampling, DigitScores, add_sampling_arguments, describe

RECIPE_DIR = Path(__file__).resolve().parents[1]  # the dit recipe folder this package lives in
TRAIN_ENTRY = RECIPE_DIR / "pretrain_dit_model.py"
CI_CONFIG = RECIPE_DIR / "conf" / "digits_tiny.yaml"
CLIP_CONFIG = RECIPE_DIR / "conf" / "digits_video_tiny.yaml"


def child_env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads)}


def run_child(cmd: list[str], log_file: Path, threads: int, timeout: int | None) -> None:
    """Run to exit with output in ``log_file``; raise with its tail on failure."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "w") as log:
        result = subprocess.run(
            cmd, cwd=RECIPE_DIR, env=child_env(threads), stdout=log, stderr=subprocess.STDOUT, timeout=timeout
        )
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {result.returncode}):\n{log_file.read_text()[-4000:]}")


def prepare_digits(
    root: str | Path, patch_spatial: int = 2, clips: ClipSpec | None = None, limit: int | None = None
) -> Path:
    """Tiny T5 under ``root/t5``, identity VAE under ``root/vae``, energon dataset under ``root/dataset``
    (reused when already there): the 8x8 digits, or moving-digit clips of ``clips``."""
    root = Path(root)
    dataset_dir = root / "dataset"
    if (dataset_dir / ".nv-meta" / "dataset.yaml").is_file():
        return dataset_dir
    build_digit_text_encoder(root / "t5")
    if clips is None:
        write_digit_vae(root / "vae")
        return prepare_digits_dataset(root, root / "t5", root / "vae", patch_spatial, limit)[0]
    write_clip_vae(root / "vae", clips)
    return prepare_clips_dataset(root, root / "t5", root / "vae", clips, patch_spatial, limit)[0]


def train_digits(
    dataset_dir: Path,
    out_dir: Path,
    config: Path = CI_CONFIG,
    overrides: Sequence[str] = (),
    threads: int = 1,
    timeout: int | None = 3600,
) -> Path:
    """``pretrain_dit_model.py --config-file CONFIG dataset.path=...``; -> the checkpoint root.
    ``timeout``: seconds before the training is killed (a hung CI run); None: no limit."""
    # Absolute: the entry point runs in the recipe folder.
    dataset_dir, out_dir = Path(dataset_dir).resolve(), Path(out_dir).resolve()
    cmd = [
        sys.executable,
        str(TRAIN_ENTRY),
        "--config-file",
        str(config),
        f"dataset.path={dataset_dir}",
        f"checkpoint.save={out_dir / 'ckpt'}",
        f"logger.log_dir={out_dir / 'logs'}",
        *overrides,
    ]
    run_child(cmd, out_dir / "train.log", threads, timeout)
    return out_dir / "ckpt"


def read_losses(out_dir: Path) -> list[tuple[int, float]]:
    """(iteration, loss) of every logged iteration of a ``train_digits`` run."""
    lines = (Path(out_dir) / "logs" / "metrics.jsonl").read_text().splitlines()
    return [(r["iteration"], r["loss"]) for r in map(json.loads, lines) if "loss" in r]


def score_digits(
    checkpoints: Sequence[Path],
    root: Path,
    sampling: DigitSampling,
    json_path: Path,
    threads: int = 1,
    timeout: int | None = 3600,
) -> list[dict]:
    """``python -m digits.evaluate`` on each checkpoint, with the encoders ``prepare_digits``
    wrote under ``root`` -> the scores (also in ``json_path``)."""
    root, json_path = Path(root).resolve(), Path(json_path).resolve()
    checkpoints = [Path(c).resolve() for c in checkpoints]
    flags = {k: v for k, v in asdict(sampling).items() if v is not None}
    cmd = [
        sys.executable,
        "-m",
        "digits.evaluate",
        "--checkpoint",
        *map(str, checkpoints),
        "--t5",
        str(root / "t5"),
        "--vae",
        str(root / "vae"),
        "--json",
        str(json_path),
        *[f"--{k}={v}" for k, v in flags.items()],
    ]
    run_child(cmd, Path(json_path).with_suffix(".log"), threads, timeout)
    return json.loads(Path(json_path).read_text())


@dataclass
class PipelineRun:
    losses: list[tuple[int, float]]  # (iteration, training loss)
    scores: list[dict]  # one per saved checkpoint, in iteration order
    seconds: float  # training + scoring wall time


def train_and_score(
    root: Path,
    name: str,
    config: Path,
    overrides: Sequence[str],
    sampling: DigitSampling,
    threads: int = 1,
    timeout: int | None = 3600,
) -> PipelineRun:
    """Train with ``overrides`` on ``root/dataset`` into ``root/<name>``, score every saved checkpoint
    (``timeout``: of each child process; None: no limit)."""
    start = time.perf_counter()
    out = Path(root) / name
    checkpoint_root = train_digits(Path(root) / "dataset", out, config, overrides, threads, timeout)
    scores = score_digits(sorted(checkpoint_root.glob("iter_*")), root, sampling, out / "scores.json", threads, timeout)
    return PipelineRun(read_losses(out), scores, time.perf_counter() - start)


def train_and_score_pipelines(
    root: Path,
    pipelines: Sequence[str],
    config: Path,
    overrides: Sequence[str],
    sampling: DigitSampling,
    threads: int = 1,
) -> dict[str, PipelineRun]:
    """``train_and_score`` for each pipeline side by side (one single-threaded child each: 2 cores, 2 runs)."""
    runs = {p: [f"model.pipeline={p}", *overrides] for p in pipelines}
    return train_and_score_runs(root, runs, config, sampling, threads)


def train_and_score_runs(
    root: Path,
    runs: Mapping[str, Sequence[str]],
    config: Path,
    sampling: DigitSampling,
    threads: int = 1,
    parallel: int = 2,
) -> dict[str, PipelineRun]:
    """``train_and_score`` for each named list of overrides, ``parallel`` at a time (one child each)."""
    run = lambda name: train_and_score(root, name, config, runs[name], sampling, threads)  # noqa: E731
    with ThreadPoolExecutor(max(1, min(parallel, len(runs)))) as pool:
        return dict(zip(runs, pool.map(run, runs)))


def summarise(runs: Mapping[str, PipelineRun]) -> dict[str, dict]:
    """Print each run's last scores (as docs/learning.md quotes them) -> a JSON-able summary."""
    summary = {}
    for name, run in runs.items():
        final = run.scores[-1]
        print(f"{name}: {describe(DigitScores(**final))} (iteration {final['iteration']}, {run.seconds / 60:.1f} min)")
        summary[name] = {
            "iterations": final["iteration"],
            "minutes": round(run.seconds / 60, 1),
            "final_loss": run.losses[-1][1],
            "curve": [{k: v for k, v in s.items() if k != "samples"} for s in run.scores],
        }
    return summary


def demo_parser(
    doc: str, out_dir: str, config: Path, pipelines: Sequence[str], eval_interval: int
) -> argparse.ArgumentParser:
    """The flags both demos share: where, which config and pipelines, how often to score, sampling, threads."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", default=out_dir)
    p.add_argument("--config", default=str(config))
    p.add_argument("--pipelines", nargs="+", default=list(pipelines), choices=["edm", "flow"])
    p.add_argument(
        "--eval_interval", type=int, default=eval_interval, help="save and score a checkpoint every N iterations"
    )
    add_sampling_arguments(p)
    p.add_argument("--threads", type=int, default=1, help="OMP threads per child process")
    p.add_argument("overrides", nargs="*", help="training config overrides, key=value")
    return p
