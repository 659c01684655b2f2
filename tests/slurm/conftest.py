"""A real one-node Slurm cluster on localhost (Debian's slurm-wlm + munge), started once per session.

Everything (munge key and socket, slurm.conf, state, logs, pid files) lives in one temporary directory;
the daemons run as root on free ports, without cgroups (proctrack/linuxproc, task/none), and are stopped
at the end. The packages come from scripts/ci/install_slurm.sh (which .ci/run calls); without them the tests skip.
Installed daemons that fail to start skip the tests on a workstation but fail them under ``CI=true``:
there the install script just ran, so a start failure is a defect to see, not a missing tool.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

DAEMONS = ("munged", "slurmctld", "slurmd")


@dataclass
class SlurmCluster:
    root: Path
    env: dict[str, str]

    def run(self, *cmd: str, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("env", self.env)
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)

    def job_field(self, job_id: str, name: str) -> str:
        """A field of `scontrol show job` (JobState, Restarts, ...); jobs stay listed MinJobAge (300 s) after ending."""
        out = self.run("scontrol", "-o", "show", "job", job_id).stdout
        return dict(f.split("=", 1) for f in out.split() if "=" in f).get(name, "")

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted((self.root / "log").glob("*.log")))


def _missing_packages() -> str | None:
    """None when the daemons are installed, else what to run (tests never install system packages)."""
    if all(shutil.which(d) for d in DAEMONS) and shutil.which("sbatch"):
        return None
    return "Slurm (slurm-wlm + munge) is not installed: run scripts/ci/install_slurm.sh (as root)"


def start_failed(message: str) -> None:
    """Skip, or under ``CI=true`` (set by CI services) fail, with the daemons' logs in ``message``."""
    if os.environ.get("CI", "").lower() in ("true", "1"):
        pytest.fail(f"CI=true: {message}", pytrace=False)
    pytest.skip(message)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slurm_conf(root: Path, host: str, cpus: int) -> str:
    return f"""\
ClusterName=dfmtest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.socket,cred_expire=5
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
KillWait=10
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def _stop(root: Path) -> None:
    for name in reversed(DAEMONS):
        pid_file = root / f"{name}.pid"
        try:
            pid = int(pid_file.read_text().strip())
        except (OSError, ValueError):
            continue
        try:
            os.kill(pid, signal.SIGTERM)
            for _ in range(50):
                os.kill(pid, 0)
                time.sleep(0.1)
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="session")
def slurm_cluster():
    if sys.platform != "linux":
        pytest.skip("Slurm tests need Linux")
    if os.geteuid() != 0:
        pytest.skip("starting slurmctld/slurmd/munged here needs root")
    reason = _missing_packages()
    if reason:
        pytest.skip(reason)

    root = Path(tempfile.mkdtemp(prefix="dfm-slurm-"))
    root.chmod(0o755)
    for sub in ("state", "spool", "log"):
        (root / sub).mkdir()
    host = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(_slurm_conf(root, host, max(2, os.cpu_count() or 1)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    env["SLURM_CONF"] = str(conf)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}:/usr/sbin:/sbin"
    try:
        socket.gethostbyname(host)  # the launcher's rendezvous address is the first node's name
    except OSError:
        env["MASTER_ADDR"] = "127.0.0.1"
    cluster = SlurmCluster(root, env)

    starts = [
        ["mungekey", "--create", f"--keyfile={root}/munge.key"],
        [
            "munged",
            "--force",
            f"--socket={root}/munge.socket",
            f"--key-file={root}/munge.key",
            f"--log-file={root}/log/munged.log",
            f"--pid-file={root}/munged.pid",
            f"--seed-file={root}/munged.seed",
        ],
        ["slurmctld", "-i"],
        ["slurmd", "-N", host],
    ]
    try:
        for cmd in starts:
            result = cluster.run(*cmd, timeout=30)
            if result.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} exited {result.returncode}: {result.stderr.strip()}")
        deadline = time.monotonic() + 30
        while cluster.run("sinfo", "-h", "-o", "%t").stdout.strip() != "idle":
            if time.monotonic() > deadline:
                raise RuntimeError(f"node not idle after 30 s: {cluster.run('sinfo').stdout}")
            time.sleep(0.5)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
        logs = cluster.logs()
        _stop(root)
        shutil.rmtree(root, ignore_errors=True)
        start_failed(f"could not start Slurm: {error}\n{logs}")

    yield cluster

    cluster.run("scancel", "--user=root", timeout=30)
    deadline = time.monotonic() + 30
    while cluster.run("squeue", "-h").stdout.strip() and time.monotonic() < deadline:
        time.sleep(0.5)
    _stop(root)
    shutil.rmtree(root, ignore_errors=True)
