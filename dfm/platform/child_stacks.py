"""Forked children write their Python stacks on request, so that a stall's dump shows them too.

A rank waiting for a stuck async-save writer shows only ``join`` in its own stacks; the writer (megatron's
forked ``TemporalAsyncCaller`` process and its own forked writers) is where the stall is. Every child this
process forks registers ``faulthandler`` for ``CHILD_STACKS_SIGNAL``: on it, the child writes every thread's
stack to stderr and carries on. The stall watchdog and the exit deadline ask every descendant that caught
the signal (``SigCgt`` in /proc) before they exit; a process that did not register it is not sent it.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from pathlib import Path

from dfm.platform.fork_hooks import at_fork_once

CHILD_STACKS_SIGNAL = signal.SIGUSR2
WAIT_S = 1.0  # for the children to write theirs before the parent exits and takes them with it


def children_write_stacks_on_request() -> None:
    """Register (once per process) a fork hook: every child writes its stacks on ``CHILD_STACKS_SIGNAL``."""
    at_fork_once(after_in_child=_write_stacks_on_request)


def crash_writes_stacks() -> None:
    """A fatal signal in this process (a segfault or abort in a kernel, a collective, a forked writer) writes
    every thread's Python stack to stderr before the process dies as before (same signal, same exit code):
    a rank that dies with -11 or -6 otherwise leaves nothing saying where it was."""
    faulthandler.enable(file=sys.stderr, all_threads=True)


def _write_stacks_on_request() -> None:
    faulthandler.register(CHILD_STACKS_SIGNAL, file=sys.stderr, all_threads=True)


def ask_children_for_stacks(wait_s: float = WAIT_S) -> list[int]:
    """Send the signal to every descendant that catches it and wait ``wait_s`` -> the pids asked."""
    asked = [pid for pid in descendants(os.getpid()) if catches(pid, CHILD_STACKS_SIGNAL)]
    for pid in asked:
        try:
            os.kill(pid, CHILD_STACKS_SIGNAL)
        except ProcessLookupError:
            pass
    if asked:
        sys.stderr.write(f"dfm: Python stacks of the child processes {asked} follow\n")
        sys.stderr.flush()
        time.sleep(wait_s)
    return asked


def descendants(pid: int) -> list[int]:
    """Children, grandchildren, ... of ``pid`` (Linux /proc; [] elsewhere)."""
    found, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def children(pid: int) -> list[int]:
    """The children of every thread of ``pid`` (a child forked by a thread is listed under that thread)."""
    pids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            pids += [int(word) for word in (task / "children").read_text().split()]
        except OSError:
            continue
    return pids


def live_children(pid: int) -> list[int]:
    """``children`` that are not zombies (a child that exited and was not reaped yet)."""
    return [child for child in children(pid) if _running(child)]


def _running(pid: int) -> bool:
    """``pid`` exists and is not a zombie (its state in /proc/PID/stat, after the command name)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :][:1] not in ("Z", "X")


def catches(pid: int, sig: int) -> bool:
    """``pid`` has a handler for ``sig`` (its ``SigCgt`` mask in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next((line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), "0")
    return bool(int(mask, 16) >> (sig - 1) & 1)
