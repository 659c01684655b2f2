"""A stall watchdog: a step or a save that makes no progress for ``train.stall_timeout_s`` ends the rank.

The training loop calls ``beat(what)`` as each iteration, validation and save begins. A thread checks the
time since the last beat; past the timeout it writes every thread's Python stack of this rank to stderr
(``faulthandler``: it works while the main thread is stuck in C code or a collective) with what was running,
and exits with ``STALL_EXIT_CODE``, so a launcher (torchrun, Slurm) sees a failure and can requeue the job.
The processes the rank forked write theirs too (dfm/platform/child_stacks.py) and end with it
(dfm/platform/parent_watch.py).
"""

from __future__ import annotations

import contextlib
import faulthandler
import fcntl
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from dfm.platform.child_stacks import ask_children_for_stacks

STALL_EXIT_CODE = 3
DUMP_LOCK_WAIT_S = 10.0  # the longest a rank waits for another's dump before writing its own anyway
GPU_DEFAULT_S = 30 * 60.0  # train.stall_timeout_s=null on GPUs; on CPUs null is off (steps vary too much there)


def stall_timeout(configured: float | None, on_gpu: bool) -> float | None:
    """The timeout in effect: the configured one (0: off), else 30 min on GPUs and none on CPUs."""
    if configured is None:
        return GPU_DEFAULT_S if on_gpu else None
    return configured or None


class StallWatchdog:
    """``beat(what)`` marks progress; no beat for ``timeout_s`` dumps the stacks and exits. None: a no-op."""

    def __init__(self, timeout_s: float | None, rank: int = 0) -> None:
        self.timeout_s, self.rank = timeout_s, rank
        self.what, self.last = "start-up", time.monotonic()
        self._stopped = threading.Event()
        if timeout_s is not None:
            threading.Thread(target=self._watch, name="dfm-stall-watchdog", daemon=True).start()

    def beat(self, what: str) -> None:
        self.what, self.last = what, time.monotonic()

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        while not self._stopped.wait(min(1.0, self.timeout_s / 10)):
            idle = time.monotonic() - self.last
            if idle > self.timeout_s:
                self._fire(idle)

    def _fire(self, idle: float) -> None:
        dump_stacks(
            f"dfm stall watchdog: rank {self.rank} made no progress for {idle:.0f} s during {self.what} "
            f"(train.stall_timeout_s={self.timeout_s:g}); Python stacks of every thread of this rank follow, "
            f"then it exits {STALL_EXIT_CODE}"
        )
        os._exit(STALL_EXIT_CODE)


def dump_stacks(message: str) -> None:
    """``message``, then every thread's Python stack, to stderr (``faulthandler``: works while the main
    thread is stuck in C code or a collective), then those of the processes it forked (a checkpoint writer).
    One process of the node at a time (``one_dump_at_a_time``): ranks that share a log write their dumps
    whole instead of interleaved character by character."""
    with one_dump_at_a_time():
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        ask_children_for_stacks()


@contextlib.contextmanager
def one_dump_at_a_time(wait_s: float = DUMP_LOCK_WAIT_S):
    """Hold the node's stack-dump lock (an advisory ``flock`` on a file in the temp folder) for the block; after
    ``wait_s`` without it, or without a lock file, dump anyway: a dump must never be what keeps a rank alive."""
    path = Path(tempfile.gettempdir()) / f"dfm-stack-dumps-{os.getuid()}.lock"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError:
        yield
        return
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock
