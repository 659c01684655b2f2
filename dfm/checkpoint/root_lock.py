"""One run per checkpoint root: ``<checkpoint.save>/run.lock`` names the run that writes there.

Taken by rank 0 at start-up before anything is written into the root (all ranks agree on the
outcome), released at exit. The lock file holds host, pid, the process's start (``/proc`` start
ticks, so a reused pid is not mistaken for the holder) and the wall-clock start time.

- Held by a live process on this host: refused, naming host, pid and start time.
- Held by a process on this host that is gone: stale; taken over, with a warning naming it.
- Held by an earlier incarnation of this Slurm job (same ``SLURM_JOB_ID``, lower
  ``SLURM_RESTART_COUNT``): taken over, on any host; Slurm requeues a job only once all of its
  earlier steps have ended, so a node that died mid-run never blocks the requeue elsewhere.
- Held by another host otherwise: refused. Whether a process elsewhere still runs cannot be told
  from here, so such a lock is never taken over automatically; the message says to delete the file
  once that run is known to be gone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from dfm.checkpoint.collective import decided_on_rank0, rank
from dfm.checkpoint.errors import CheckpointError
from dfm.safe_files import links_leaving

logger = logging.getLogger("dfm.checkpoint")

LOCK = "run.lock"


def _process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux ``/proc``), None if unknown or gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])


def this_process() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "process_start": _process_start(os.getpid()),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime()),
        "slurm_job": os.environ.get("SLURM_JOB_ID"),
        "slurm_restart": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
    }


def is_earlier_incarnation(owner: dict, me: dict) -> bool:
    """The lock's run was this Slurm job before a requeue (which Slurm starts only after it ended)."""
    restart = owner.get("slurm_restart")
    return (
        me["slurm_job"] is not None
        and owner.get("slurm_job") == me["slurm_job"]
        and isinstance(restart, int)
        and restart < me["slurm_restart"]
    )


def describe(owner: dict) -> str:
    return f"host {owner.get('host')}, pid {owner.get('pid')}, started {owner.get('started')}"


def is_running_here(owner: dict) -> bool:
    """Whether the lock's process (on this host) still runs: its pid exists with the same start time."""
    pid = owner.get("pid")
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    recorded, now = owner.get("process_start"), _process_start(pid)
    return recorded is None or now is None or recorded == now


def _create(lock: Path, owner: dict) -> bool:
    """Write the lock file if none exists (atomic create); -> whether this process now holds it."""
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as handle:
        handle.write(json.dumps(owner) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    return True


def _read(lock: Path) -> dict | None:
    try:
        owner = json.loads(lock.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def acquire(root: str | Path) -> tuple[Path, dict]:
    """Take ``<root>/run.lock`` for this process (see the module docstring); -> (lock file, owner record).

    Raises CheckpointError naming the holder when another run holds it.
    """
    lock = Path(root) / LOCK
    lock.parent.mkdir(parents=True, exist_ok=True)
    me = this_process()
    for _ in range(3):  # a lock released or taken over meanwhile: try again
        if _create(lock, me):
            return lock, me
        owner = _read(lock)
        if owner == {}:
            continue
        if owner is None:
            raise CheckpointError(
                f"checkpoint.save={root}: the lock file {lock} is unreadable; if no run writes to this root, delete it"
            )
        if is_earlier_incarnation(owner, me):
            pass  # taken over below
        elif owner.get("host") != me["host"]:
            raise CheckpointError(
                f"checkpoint.save={root} is locked by a run on another host ({describe(owner)}, lock file {lock}). "
                "dfm cannot tell from here whether it still runs, so it never takes such a lock over: once that "
                f"run is gone, delete {lock}; or use another checkpoint.save"
            )
        elif is_running_here(owner):
            raise CheckpointError(
                f"checkpoint.save={root} is in use by another run ({describe(owner)}, lock file {lock}): two runs "
                "would overwrite each other's checkpoints. Wait for it to end or use another checkpoint.save"
            )
        stale = lock.with_name(f"{LOCK}.stale-{os.getpid()}")
        with contextlib.suppress(FileNotFoundError):  # another process took it over first: retry
            os.rename(lock, stale)
            stale.unlink()
            logger.warning("taking over the stale lock %s of a run that is gone (%s)", lock, describe(owner))
    raise CheckpointError(f"checkpoint.save={root}: could not take the lock file {lock} (other runs keep taking it)")


def refuse_links_leaving(root: str | Path) -> None:
    """dfm writes and deletes in the root, never through links: a root holding links out of it is refused."""
    if not Path(root).is_dir():
        return
    links = links_leaving(root)
    if links:
        raise CheckpointError(
            f"checkpoint.save={root} holds symbolic links pointing outside it: {', '.join(links)}. dfm writes and "
            "deletes files in its checkpoint root and never through a link; remove them (or use another "
            "checkpoint.save)"
        )


def release(lock: Path, owner: dict) -> None:
    """Remove the lock file if it is still this owner's."""
    if _read(lock) == owner:
        lock.unlink(missing_ok=True)


@contextlib.contextmanager
def root_locked(root: str | None) -> Iterator[None]:
    """Hold ``root``'s lock for the ``with`` block (rank 0 takes it, every rank gets the verdict); None: no lock."""
    if not root:
        yield
        return
    held: list[tuple[Path, dict]] = []

    def take() -> str | None:
        try:
            refuse_links_leaving(root)
            held.append(acquire(root))
        except CheckpointError as error:
            return str(error)
        return None

    refusal = decided_on_rank0(take)
    if refusal:
        raise CheckpointError(refusal)
    try:
        yield
    finally:
        if rank() == 0 and held:
            release(*held[0])
