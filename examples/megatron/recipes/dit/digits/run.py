"""The whole "it learns" path as three calls, shared by the CI test and the longer demo:

    dataset_dir = prepare_digits(root)                                   # image folder -> energon shards
    ckpt = train_digits(dataset_dir, root / "edm", CONF, ["model.pipeline=edm"])   # the real entry point
    scores = score_digits([ckpt], root, DigitSampling(), root / "edm/scores.json")

Training and scoring run as child processes (the real scripts, each with its own torch.distributed),
so a caller never holds process groups. Children run in the recipe folder, so ``python -m digits.evaluate``
finds this package.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from digits.data import build_digit_text_encoder, prepare_digits_dataset, write_digit_vae
from digits.evaluate import DigitSampling

RECIPE_DIR = Path(__file__).resolve().parents[1]  # the dit recipe folder this package lives in
TRAIN_ENTRY = RECIPE_DIR / "pretrain_dit_model.py"
CI_CONFIG = RECIPE_DIR / "conf" / "digits_tiny.yaml"


def child_env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads)}


def run_child(cmd: list[str], log_file: Path, threads: int, timeout: int) -> None:
    """Run to exit with output in ``log_file``; raise with its tail on failure."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "w") as log:
        result = subprocess.run(
            cmd, cwd=RECIPE_DIR, env=child_env(threads), stdout=log, stderr=subprocess.STDOUT, timeout=timeout
        )
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {result.returncode}):\n{log_file.read_text()[-4000:]}")


def prepare_digits(root: str | Path, patch_spatial: int = 2) -> Path:
    """Tiny T5 under ``root/t5``, identity VAE under ``root/vae``, energon dataset under ``root/dataset``
    (reused when already there)."""
    root = Path(root)
    dataset_dir = root / "dataset"
    if (dataset_dir / ".nv-meta" / "dataset.yaml").is_file():
        return dataset_dir
    build_digit_text_encoder(root / "t5")
    write_digit_vae(root / "vae")
    return prepare_digits_dataset(root, root / "t5", root / "vae", patch_spatial)[0]


def train_digits(
    dataset_dir: Path,
    out_dir: Path,
    config: Path = CI_CONFIG,
    overrides: Sequence[str] = (),
    threads: int = 1,
    timeout: int = 3600,
) -> Path:
    """``pretrain_dit_model.py --config-file CONFIG dataset.path=...``; -> the checkpoint root."""
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
    timeout: int = 3600,
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
    root: Path, pipeline: str, config: Path, overrides: Sequence[str], sampling: DigitSampling, threads: int = 1
) -> PipelineRun:
    """Train one pipeline on ``root/dataset`` into ``root/<pipeline>``, score every saved checkpoint."""
    start = time.perf_counter()
    out = Path(root) / pipeline
    checkpoint_root = train_digits(
        Path(root) / "dataset", out, config, [f"model.pipeline={pipeline}", *overrides], threads
    )
    scores = score_digits(sorted(checkpoint_root.glob("iter_*")), root, sampling, out / "scores.json", threads)
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
    run = lambda name: train_and_score(root, name, config, overrides, sampling, threads)  # noqa: E731
    with ThreadPoolExecutor(len(pipelines)) as pool:
        return dict(zip(pipelines, pool.map(run, pipelines)))
