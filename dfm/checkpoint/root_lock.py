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
- Empty or unreadable (a start that died while writing it, with a dfm before whole-record locks) and
  older than a few seconds: stale, taken over.

One holder, always: a lock is created by hard-linking a record written whole beforehand (atomic, fails
if a lock exists), and a stale one is replaced only if it still holds what was judged stale (compare and
swap, serialised by ``run.lock.takeover``), so two starts racing for a stale lock never both hold it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from dfm.checkpoint.collective import decided_on_rank0, rank
from dfm.checkpoint.errors import CheckpointError
from dfm.safe_files import links_leaving

logger = logging.getLogger("dfm.checkpoint")

LOCK = "run.lock"
ACQUIRE_TIMEOUT_S = 30.0
UNREADABLE_GRACE_S = 5.0  # a lock written by an older dfm (not whole before it appeared) may be mid-write
TAKEOVER_STALE_S = 30.0  # run.lock.takeover is held for microseconds: older, its start died


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


def _write_record(lock: Path, owner: dict) -> Path:
    """``owner`` written whole (and synced) to a fresh file beside ``lock``; a failed write leaves nothing."""
    tmp = lock.with_name(f"{LOCK}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(owner) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as error:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(
            f"cannot write the lock file {lock}: {error.strerror or error} (errno {error.errno}, "
            f"{shutil.disk_usage(lock.parent).free} bytes free there); free space there or use another checkpoint.save"
        ) from error
    return tmp


def _create(lock: Path, owner: dict) -> bool:
    """Make ``lock`` hold ``owner`` if no lock exists; -> whether this process now holds it.

    The record is written whole to a temporary file, then hard-linked as ``lock`` (atomic, fails if
    ``lock`` exists): a lock file is never seen empty or half written, even on a full disk."""
    tmp = _write_record(lock, owner)
    try:
        os.link(tmp, lock, follow_symlinks=False)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def _read_bytes(lock: Path) -> bytes | None:
    try:
        return lock.read_bytes()
    except FileNotFoundError:
        return None


def _parse(raw: bytes) -> dict | None:
    try:
        owner = json.loads(raw)
    except ValueError:
        return None
    return owner if isinstance(owner, dict) else None


def _age_s(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _take_over(lock: Path, seen: bytes, owner: dict) -> bool:
    """Replace ``lock`` with ``owner``'s record only if it still holds ``seen`` (compare and swap).

    Takeovers are serialised by ``run.lock.takeover`` (created with O_EXCL, held for the few microseconds of
    the compare and the rename), so two starts that judged the same lock stale never both replace it: the
    second finds the first's fresh record, not ``seen``, and backs off."""
    mutex = lock.with_name(f"{LOCK}.takeover")
    try:
        os.close(os.open(mutex, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o644))
    except FileExistsError:
        if _age_s(mutex) > TAKEOVER_STALE_S:  # a start died in those microseconds
            logger.warning("removing %s, left by a start that died while taking the lock over", mutex)
            mutex.unlink(missing_ok=True)
        return False
    try:
        if _read_bytes(lock) != seen:
            return False
        os.replace(_write_record(lock, owner), lock)
        return True
    finally:
        mutex.unlink(missing_ok=True)


def acquire(root: str | Path) -> tuple[Path, dict]:
    """Take ``<root>/run.lock`` for this process (see the module docstring); -> (lock file, owner record).

    Raises CheckpointError naming the holder when another run holds it.
    """
    lock = Path(root) / LOCK
    lock.parent.mkdir(parents=True, exist_ok=True)
    me = this_process()
    deadline = time.monotonic() + ACQUIRE_TIMEOUT_S
    while time.monotonic() < deadline:  # a lock released or taken over meanwhile: look again
        if _create(lock, me):
            return lock, me
        seen = _read_bytes(lock)
        if seen is None:
            continue
        owner = _parse(seen)
        if owner is None:
            if _age_s(lock) < UNREADABLE_GRACE_S:  # an older dfm may still be writing it
                time.sleep(0.05)
                continue
            holder = f"an unreadable lock file ({len(seen)} bytes, a start that died while writing it)"
        else:
            refuse_live_holder(root, lock, owner, me)
            holder = f"a run that is gone ({describe(owner)})"
        if _take_over(lock, seen, me):
            logger.warning("taking over the stale lock %s of %s", lock, holder)
            return lock, me
        time.sleep(0.01 * (1 + secrets.randbelow(5)))  # another start is taking it over: look again
    raise CheckpointError(f"checkpoint.save={root}: could not take the lock file {lock} (other runs keep taking it)")


def refuse_live_holder(root: str | Path, lock: Path, owner: dict, me: dict) -> None:
    """Raise CheckpointError unless ``owner`` is gone (see the module docstring)."""
    if is_earlier_incarnation(owner, me):
        return
    if owner.get("host") != me["host"]:
        raise CheckpointError(
            f"checkpoint.save={root} is locked by a run on another host ({describe(owner)}, lock file {lock}). "
            "dfm cannot tell from here whether it still runs, so it never takes such a lock over: once that "
            f"run is gone, delete {lock}; or use another checkpoint.save"
        )
    if is_running_here(owner):
        raise CheckpointError(
            f"checkpoint.save={root} is in use by another run ({describe(owner)}, lock file {lock}): two runs "
            "would overwrite each other's checkpoints. Wait for it to end or use another checkpoint.save"
        )


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
    seen = _read_bytes(lock)
    if seen is not None and _parse(seen) == owner:
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
