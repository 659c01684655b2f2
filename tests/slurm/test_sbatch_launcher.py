"""scripts/slurm/pretrain.sbatch under a real one-node Slurm (tests/slurm/conftest.py starts it).

1. The tiny DiT trains 3 iterations on CPU, 2 processes, through `sbatch` (default launcher: torchrun).
2. Preemption with the real trainer under torchrun: SIGUSR1 to the batch shell reaches the workers (not
   torchrun), they checkpoint and exit, the job requeues itself and the second run resumes and finishes.
3. The same path with LAUNCHER=srun (one task per process), with a stand-in trainer to keep it fast.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "scripts" / "slurm" / "pretrain.sbatch"

FAKE_TRAINER = """
import json, os, signal, sys, time
received = []
signal.signal(signal.SIGUSR1, lambda *_: received.append(1))
ckpt = next(a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("checkpoint.load="))
rank = int(os.environ["RANK"])
def event(name):
    record = {"event": name, "rank": rank, "world": int(os.environ["WORLD_SIZE"]),
              "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0")), "argv": sys.argv[1:]}
    with open(os.path.join(os.environ["FAKE_EVENTS"], f"rank{rank}.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\\n")
if os.path.exists(os.path.join(ckpt, "latest")):
    event("resumed")
    sys.exit(0)
event("started")
deadline = time.monotonic() + 120
while not received and time.monotonic() < deadline:
    time.sleep(0.05)
event("saved" if received else "timed out")
if rank == 0:
    os.makedirs(ckpt, exist_ok=True)
    open(os.path.join(ckpt, "latest"), "w").write("1")
"""


def wait_for(condition, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def job_ended(cluster, job_id: str) -> str:
    """The job's final state, or "" while it is pending or running. Polled here rather than through
    ``sbatch --wait``, which sleeps 2, 8, then 32 s between its own polls (a 15 s job is seen ending at 42 s)."""
    state = cluster.job_field(job_id, "JobState")
    return state if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY") else ""


def submit_dir(tmp_path: Path) -> Path:
    (tmp_path / "logs").mkdir()  # the script's `--output=logs/%x-%j.out` is relative to the submit dir
    return tmp_path


@pytest.mark.slow
def test_tiny_dit_trains_through_sbatch(slurm_cluster, tmp_path):
    cwd = submit_dir(tmp_path)
    env = {**slurm_cluster.env, "DFM_DIR": str(REPO), "NPROC_PER_NODE": "2"}
    result = slurm_cluster.run("sbatch", "--parsable", str(SBATCH), "--mock", "train.train_iters=3", cwd=cwd, env=env)
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.strip().split(";")[0]
    state = wait_for(lambda: job_ended(slurm_cluster, job_id), 300, "the job to end")
    out_file = cwd / "logs" / f"dfm-pretrain-{job_id}.out"
    output = out_file.read_text() if out_file.exists() else "(no job output)"
    assert state == "COMPLETED", output[-4000:]
    assert slurm_cluster.job_field(job_id, "ExitCode") == "0:0", output[-4000:]  # the batch script's status

    metrics = cwd / "logs" / f"dfm-pretrain-{job_id}" / "metrics.jsonl"  # the per-job default logger.log_dir
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert (cwd / "checkpoints" / f"dfm-pretrain-{job_id}" / "latest").read_text().strip() == "3"


@pytest.mark.slow
def test_preempted_training_requeues_and_resumes(slurm_cluster, tmp_path):
    """SIGUSR1 (what Slurm sends before the time limit) -> checkpoint, requeue, resume, finish: metrics 1..N once."""
    cwd = submit_dir(tmp_path)
    env = {**slurm_cluster.env, "DFM_DIR": str(REPO), "NPROC_PER_NODE": "2"}
    result = slurm_cluster.run("sbatch", "--parsable", str(SBATCH), "--mock", "train.train_iters=40", cwd=cwd, env=env)
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.strip().split(";")[0]
    metrics = cwd / "logs" / f"dfm-pretrain-{job_id}" / "metrics.jsonl"
    out_file = cwd / "logs" / f"dfm-pretrain-{job_id}.out"

    def iterations() -> list[int]:
        return [json.loads(line)["iteration"] for line in metrics.read_text().splitlines()] if metrics.exists() else []

    wait_for(lambda: len(iterations()) >= 3, 120, "3 logged iterations")
    assert slurm_cluster.run("scancel", "--batch", "--signal=USR1", job_id).returncode == 0
    state = wait_for(
        lambda: slurm_cluster.job_field(job_id, "Restarts") == "1" and job_ended(slurm_cluster, job_id),
        150,
        "the requeued job to finish",
    )
    output = out_file.read_text()
    assert state == "COMPLETED", output[-4000:]
    assert "preemption signal received" in output and "requeueing job" in output
    assert "loaded checkpoint" in output
    assert iterations() == list(range(1, 41))  # the second run continued where the first stopped


@pytest.mark.slow
def test_usr1_reaches_every_srun_task_and_requeues(slurm_cluster, tmp_path):
    cwd = submit_dir(tmp_path)
    (cwd / "fake_trainer.py").write_text(FAKE_TRAINER)
    events_dir = cwd / "events"
    events_dir.mkdir()
    env = {
        **slurm_cluster.env,
        "DFM_DIR": str(REPO),
        "NPROC_PER_NODE": "2",
        "LAUNCHER": "srun",
        "ENTRY": str(cwd / "fake_trainer.py"),
        "FAKE_EVENTS": str(events_dir),
    }
    result = slurm_cluster.run(
        "sbatch", "--parsable", "--job-name=preempt", str(SBATCH), "model.num_layers=1", cwd=cwd, env=env
    )
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.strip().split(";")[0]
    out_file = cwd / "logs" / f"preempt-{job_id}.out"

    def events(rank: int) -> list[dict]:
        path = events_dir / f"rank{rank}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    wait_for(lambda: all(events(r) for r in (0, 1)), 90, "both ranks to start")
    assert slurm_cluster.run("scancel", "--batch", "--signal=USR1", job_id).returncode == 0

    # A requeued job may start again after AuthInfo's cred_expire + 1 s (120 s by default; 5 s in conftest).
    wait_for(lambda: slurm_cluster.job_field(job_id, "Restarts") == "1", 60, "the job to requeue")
    state = wait_for(
        lambda: job_ended(slurm_cluster, job_id),
        120,
        "the requeued job to finish",
    )
    output = out_file.read_text()
    job = slurm_cluster.run("scontrol", "show", "job", job_id).stdout
    assert state == "COMPLETED", f"{output[-3000:]}\n{job}\n{slurm_cluster.logs()}"

    ckpt = cwd / "checkpoints" / f"preempt-{job_id}"
    for rank in (0, 1):
        got = events(rank)
        assert [(e["event"], e["restart"]) for e in got] == [("started", 0), ("saved", 0), ("resumed", 1)], got
        assert all(e["world"] == 2 for e in got)
        for e in got:  # same per-job dirs on both runs, the user's override last
            assert f"checkpoint.load={ckpt}" in e["argv"] and e["argv"][-1] == "model.num_layers=1"
    assert "requeueing job" in output and output.count("training exited with status 0") == 2
