"""``python tests/rank_launcher.py NPROC SCRIPT [ARGS...]``: NPROC ranks of SCRIPT on this host, as
torchrun's workers see them (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, a run id), without its agent.

For tests whose subject is the run, not the launcher: torchrun's agent imports torch and its elastic
machinery, ~4 s of CPU per launch. Rank 0 hosts the rendezvous store (``env://``). As under torchrun, the
first rank to fail ends the others (SIGTERM, SIGKILL after a grace period), each failed rank is reported
("rank R failed, exitcode : N", as torchrun words it) and the launcher exits 1;
the ranks exit with it (``TORCHELASTIC_RUN_ID``: dfm's workers die with their launcher). The launcher
itself (preemption signals, launcher death, Slurm) is tested through torchrun.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid

GRACE_S = 30.0


def launcher_command(nproc: int) -> list[str]:
    """The command line that precedes a script and its arguments to run it as ``nproc`` ranks."""
    return [sys.executable, os.path.abspath(__file__), str(nproc)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_env(rank: int, nproc: int, port: int, run_id: str) -> dict[str, str]:
    return {
        **os.environ,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": run_id,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }


def launch(nproc: int, command: list[str]) -> int:
    """Run the ranks to exit -> 0 if all exited 0, else 1."""
    port, run_id = free_port(), uuid.uuid4().hex
    ranks = [subprocess.Popen(command, env=rank_env(rank, nproc, port, run_id)) for rank in range(nproc)]
    signal.signal(signal.SIGTERM, lambda *_: _end(ranks, signal.SIGTERM))
    while True:
        codes = [rank.poll() for rank in ranks]
        if any(code not in (None, 0) for code in codes):
            _end(ranks)
            for rank, process in enumerate(ranks):  # as torchrun's failure report words it
                if process.returncode:
                    print(f"rank_launcher: rank {rank} failed, exitcode : {process.returncode}", file=sys.stderr)
            return 1
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.05)


def _end(ranks: list[subprocess.Popen], how: signal.Signals = signal.SIGTERM) -> None:
    for rank in ranks:
        if rank.poll() is None:
            rank.send_signal(how)
    deadline = time.monotonic() + GRACE_S
    for rank in ranks:
        try:
            rank.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rank.kill()


if __name__ == "__main__":
    sys.exit(launch(int(sys.argv[1]), [sys.executable, *sys.argv[2:]]))
