"""Run the real pretrain entry point (optionally under torchrun) from tests."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

RECIPE_DIR = Path(__file__).resolve().parents[2] / "examples" / "megatron" / "recipes" / "dit"
ENTRY = RECIPE_DIR / "pretrain_dit_model.py"
FAULT_ENTRY = Path(__file__).resolve().parent / "_fault_entry.py"
TINY = RECIPE_DIR / "conf" / "dit_tiny.yaml"


def entry_command(
    nproc: int, overrides: list[str], entry: Path = ENTRY, config: Path = TINY, mock: bool = True
) -> list[str]:
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    return [*launcher, str(entry), "--config-file", str(config), *(["--mock"] if mock else []), *overrides]


def entry_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **(extra or {})}


def run_entry(
    nproc: int,
    overrides: list[str],
    entry: Path = ENTRY,
    env: dict[str, str] | None = None,
    timeout: int = 600,
    config: Path = TINY,
    mock: bool = True,
) -> subprocess.CompletedProcess:
    """Run to exit. Output goes through files, not pipes: a rank killed mid-save orphans
    dist_checkpointing's helper processes, which would hold a pipe open forever; the whole
    process group is killed afterwards for the same reason."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            entry_command(nproc, overrides, entry, config, mock),
            stdout=out,
            stderr=err,
            text=True,
            env=entry_env(env),
            cwd=RECIPE_DIR,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=timeout)
        finally:
            kill_group(proc.pid)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def read_metrics(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(log_dir) / "metrics.jsonl").read_text().splitlines()]


def prepare_shards(media: Path, out: Path, *flags) -> Path:
    """prepare_energon_dataset.py, in this process, of the files in ``media`` into ``out`` with ``flags``
    and the real ``energon prepare`` -> ``out``; a nonzero exit fails the test."""
    script = importlib.util.spec_from_file_location("prepare", RECIPE_DIR / "prepare_energon_dataset.py")
    module = importlib.util.module_from_spec(script)
    script.loader.exec_module(module)
    args = ["--input_dir", str(media), "--output_dir", str(out), *map(str, flags), "--run_energon_prepare"]
    assert module.main(args) == 0
    return Path(out)
