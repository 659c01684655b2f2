"""Preemption as launchers deliver it, during a save: 2 ranks under torchrun, the save of iteration 2
slowed (tests/training/_fault_entry.py ``slow_save``) and SIGTERM sent once it has started.

- ``torchrun``: to the torchrun agent, which forwards it to each worker's process group and kills
  them after its shutdown timeout (``--shutdown-timeout``, 30 s by default); torch's agent then
  exits 1 (``SignalException``) whatever its workers did, so the workers' own clean exit is checked.
- ``worker_groups``: to each worker's process group, as torchrun's agent forwards it (the agent itself
  is not signalled), so the agent sees its workers exit 0 and exits 0.
- ``every_process``: to the agent, the workers and every process they started, as Slurm signals a
  job step; the agent is started as scripts/slurm/pretrain.sbatch starts it (SIGTERM ignored, left
  to the workers), so the job exits 0.

Each run must save, exit cleanly with a checkpoint that verifies, and resume to the losses of an
uninterrupted run, bit for bit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from entry import FAULT_ENTRY, TINY, entry_env, kill_group, python_command, read_metrics, run_entry, start_faulty_run

ITERS = 8


def torchrun(entry: Path, overrides: list[str], how: str) -> list[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    if how == "every_process":  # as pretrain.sbatch starts it
        launcher = [
            "bash",
            "-c",
            'trap "" TERM; exec "$@"',
            "job",
            *launcher,
            "--signals-to-handle=SIGINT,SIGHUP,SIGQUIT",
        ]
    return [*launcher, str(entry), "--config-file", str(TINY), "--mock", *overrides]


def losses(log_dir: Path) -> dict[int, float]:
    return {r["iteration"]: r["loss"] for r in read_metrics(log_dir) if "loss" in r}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    log_dir = tmp_path_factory.mktemp("reference") / "logs"
    result = run_entry(2, [f"train.train_iters={ITERS}", f"logger.log_dir={log_dir}"])
    assert result.returncode == 0, result.stderr[-4000:]
    return losses(log_dir)


def signal_job(agent: psutil.Process, how: str) -> None:
    if how == "torchrun":
        agent.send_signal(signal.SIGTERM)
        return
    if how == "worker_groups":
        own = os.getpgid(agent.pid)
        for group in {os.getpgid(child.pid) for child in agent.children()} - {own}:
            os.killpg(group, signal.SIGTERM)
        return
    for process in [agent, *agent.children(recursive=True)]:
        try:
            process.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass


def wait_for(path: Path, text: str, proc: subprocess.Popen, seconds: float = 300) -> None:
    deadline = time.time() + seconds
    while text not in path.read_text():
        assert proc.poll() is None and time.time() < deadline, f"no {text!r}:\n{path.read_text()[-4000:]}"
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize(
    "how, save",
    [
        ("torchrun", "async"),
        ("worker_groups", "sync"),
        ("worker_groups", "async"),
        ("every_process", "sync"),
        ("every_process", "async"),
    ],
)
def test_sigterm_during_a_save_saves_and_resumes_exactly(tmp_path, reference, how, save):
    root, log_dir, err = tmp_path / "ckpt", tmp_path / "logs", tmp_path / "stderr"
    overrides = [
        "train.train_iters=1000",
        f"logger.log_dir={log_dir}",
        f"checkpoint.save={root}",
        "checkpoint.save_interval=2",
        f"checkpoint.async_save={save == 'async'}",
    ]
    with err.open("w") as stderr:
        proc = start_faulty_run(torchrun(FAULT_ENTRY, overrides, how), "slow_save:2:2", stderr)
        try:
            wait_for(err, "slow save of iter_0000002 writing", proc)
            signal_job(psutil.Process(proc.pid), how)
            proc.wait(timeout=120)
        finally:
            kill_group(proc.pid)
    log = err.read_text()
    assert "forcefully exiting" not in log and "Broken pipe" not in log, log[-4000:]
    assert log.count("exiting after the preemption signal: checkpoint") == 2, log[-4000:]
    if how == "torchrun":
        assert proc.returncode == 1 and "SignalException: Process" in log, log[-4000:]
    else:
        assert proc.returncode == 0, log[-4000:]
    stopped = int((root / "latest").read_text())
    assert 2 < stopped < ITERS
    check = subprocess.run(
        [*python_command(1), "-m", "dfm.checkpoint", "verify", str(root)],
        capture_output=True,
        text=True,
        env=entry_env(),
    )
    assert check.returncode == 0, check.stdout + check.stderr
    first = losses(log_dir)
    assert first == {i: reference[i] for i in range(1, stopped + 1)}
    resumed_logs = tmp_path / "resumed"
    result = run_entry(2, [f"train.train_iters={ITERS}", f"logger.log_dir={resumed_logs}", f"checkpoint.load={root}"])
    assert result.returncode == 0, result.stderr[-4000:]
    assert losses(resumed_logs) == {i: reference[i] for i in range(stopped + 1, ITERS + 1)}
