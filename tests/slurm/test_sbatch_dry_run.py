"""`DRY_RUN=1 bash scripts/slurm/pretrain.sbatch ...` prints the launch outside Slurm (no cluster needed)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SBATCH = Path(__file__).resolve().parents[2] / "scripts" / "slurm" / "pretrain.sbatch"


def test_dry_run_prints_the_srun_command_and_creates_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    env.update(DRY_RUN="1", GPUS_PER_NODE="0", NPROC_PER_NODE="2", DFM_DIR=str(SBATCH.parents[2]))
    out = subprocess.run(
        ["bash", str(SBATCH), "--mock", "train.train_iters=3"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    srun = out.splitlines()[-1]
    assert srun.startswith("srun --nodes=1 ") and "--nproc-per-node=2" in srun, out
    assert srun.endswith(f"checkpoint.load={tmp_path}/checkpoints/dfm-0 --mock train.train_iters=3"), out
    assert "--config-file examples/megatron/recipes/dit/conf/dit_tiny.yaml" in srun, out
    assert "rendezvous localhost:29500" in out, out
    assert list(tmp_path.iterdir()) == []  # no logs/ or checkpoints/ folder
