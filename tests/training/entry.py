"""Run the real pretrain entry point from tests: one process, or several ranks (tests/rank_launcher.py)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.rank_launcher import launcher_command
from tests.zygote import checkout_env, python_args

RECIPE_DIR = Path(__file__).resolve().parents[2] / "examples" / "megatron" / "recipes" / "dit"
ENTRY = RECIPE_DIR / "pretrain_dit_model.py"
FAULT_ENTRY = Path(__file__).resolve().parent / "_fault_entry.py"
RUNS_ENTRY = Path(__file__).resolve().parent / "_runs_entry.py"
TINY = RECIPE_DIR / "conf" / "dit_tiny.yaml"


def entry_command(
    nproc: int, overrides: list[str], entry: Path = ENTRY, config: Path = TINY, mock: bool = True
) -> list[str]:
    return [*python_command(nproc), str(entry), "--config-file", str(config), *(["--mock"] if mock else []), *overrides]


def python_command(nproc: int) -> list[str]:
    """What precedes a script to run it as ``nproc`` ranks (1: one process), each forked from the tests'
    import server (tests/zygote.py)."""
    return [*(launcher_command(nproc) if nproc > 1 else [sys.executable]), *python_args()]


def entry_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return checkout_env({**os.environ, "OMP_NUM_THREADS": "1", **(extra or {})})


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


def run_entries(
    nproc: int, runs: list[dict], folder: Path, env: dict[str, str] | None = None, seconds_per_run: int = 240
) -> list[str]:
    """Several runs of the entry point, each ``{"argv": [...], "weights": path or None}``, in as few launches
    on ``nproc`` processes as their failures allow (``_runs_entry.py``) -> each run's "ok" or its failure.

    A launch stops at a failing run; the next launch starts after it, so one failure costs only its own
    run. ``folder`` holds the run list and each run's status file."""
    folder.mkdir(parents=True, exist_ok=True)
    runs = [{**run, "status": str(folder / f"status-{index}")} for index, run in enumerate(runs)]
    runs_file = folder / "runs.json"
    runs_file.write_text(json.dumps(runs))
    pending = list(runs)
    while pending:
        with tempfile.TemporaryFile("w+") as out:
            proc = subprocess.Popen(
                [*python_command(nproc), str(RUNS_ENTRY), str(runs_file)],
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
                env=entry_env(env),
                cwd=RECIPE_DIR,
                start_new_session=True,
            )
            try:
                proc.wait(timeout=120 + seconds_per_run * len(pending))
            except subprocess.TimeoutExpired:
                pass
            finally:
                kill_group(proc.pid)
            out.seek(0)
            output = out.read()
        done = [run for run in pending if Path(run["status"]).exists()]
        if not done:  # the launch died before finishing or failing any run: the rest fail with its output
            for run in pending:
                Path(run["status"]).write_text(
                    f"launch exited {proc.returncode} before this run ended:\n{output[-6000:]}"
                )
            break
        for run in done:
            if Path(run["status"]).read_text() != "ok":
                with Path(run["status"]).open("a") as status:
                    status.write(f"\nthe launch's output:\n{output[-6000:]}")
        pending = [run for run in pending if not Path(run["status"]).exists()]
    return [Path(run["status"]).read_text() for run in runs]


def run_in_one_launch(nproc: int, runs: list[list[str]], folder: Path, config: Path = TINY, mock: bool = True) -> None:
    """Each of ``runs`` (the entry point's overrides) in turn in one launch of ``nproc`` processes
    (``run_entries``): a straight run and its resumption pay the start-up of Python and megatron-core
    (~8 CPU s a process) once. Fresh-process resumes are the fault tests' (tests/faults)."""
    argv = ["--config-file", str(config), *(["--mock"] if mock else [])]
    statuses = run_entries(nproc, [{"argv": [*argv, *overrides], "weights": None} for overrides in runs], folder)
    for overrides, status in zip(runs, statuses):
        assert status == "ok", f"{overrides}:\n{status[-6000:]}"


def start_faulty_run(command: list[str], fault: str, stderr) -> subprocess.Popen:
    """The entry point ``command`` in the recipe folder, in a session of its own, with the injected ``fault``
    (``DFM_TEST_FAULT``, tests/training/_fault_entry.py) and stderr to the open file ``stderr``."""
    return subprocess.Popen(
        command,
        cwd=RECIPE_DIR,
        env=entry_env({"DFM_TEST_FAULT": fault}),
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        start_new_session=True,
    )


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def read_metrics(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(log_dir) / "metrics.jsonl").read_text().splitlines()]


def assert_loss_falls(losses: list[float], k: int, margin: float) -> None:
    """The learning check on a smoothed loss: every loss finite, and the mean of the last ``k`` below
    ``(1 - margin)`` x the mean of the first ``k``. One pack's loss swings with its drawn noise levels, so
    one last loss against the first can pass or fail by chance."""
    assert len(losses) >= 2 * k and all(math.isfinite(x) for x in losses), losses
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    assert last < (1 - margin) * first, f"mean of the last {k} {last:.4g} vs the first {k} {first:.4g}: {losses}"


def prepare_shards(media: Path, out: Path, *flags) -> Path:
    """prepare_energon_dataset.py, in this process, of the files in ``media`` into ``out`` with ``flags``
    and the real ``energon prepare`` -> ``out``; a nonzero exit fails the test."""
    script = importlib.util.spec_from_file_location("prepare", RECIPE_DIR / "prepare_energon_dataset.py")
    module = importlib.util.module_from_spec(script)
    script.loader.exec_module(module)
    args = ["--input_dir", str(media), "--output_dir", str(out), *map(str, flags), "--run_energon_prepare"]
    assert module.main(args) == 0
    return Path(out)
