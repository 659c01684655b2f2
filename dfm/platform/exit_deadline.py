"""After a stop signal a training process ends within a bounded time, with its Python stacks.

A preemption signal (SIGTERM, SIGUSR1) only sets a flag that the training loop reads at the end of a step
(dfm/training/faults.py). A rank stuck in a save or a collective never reads it: it ran on until the
launcher's SIGKILL, leaving no stacks. Nor can a Python handler help: Python runs it only when the main
thread returns to the interpreter, which a thread blocked in C code (a gloo wait) never does. The C-level
handler still writes the signal's number to the wakeup fd (``signal.set_wakeup_fd``); a thread here reads
it. From the first stop signal on, it writes every thread's stacks after ``DUMP_AFTER_S`` (before torchrun's
SIGKILL, 30 s after its SIGTERM by default) and, if the process still runs when the timeout
(``train.exit_signal_timeout_s``) has passed, writes them again and exits ``STALL_EXIT_CODE``.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Iterable

from dfm.platform.fork_hooks import at_fork_once
from dfm.platform.watchdog import STALL_EXIT_CODE, dump_stacks

DUMP_AFTER_S = 20.0
_fork_state = {"fd": -1, "previous": -1}  # this process's wakeup fd, for forked children


class ExitDeadline:
    """``arm()`` (main thread) watches for ``signals``; the first one starts the countdown to ``timeout_s``."""

    def __init__(self, timeout_s: float, signals: Iterable[int]) -> None:
        self.timeout_s = timeout_s
        self.signals = {int(sig) for sig in signals}
        self.signalled = threading.Event()
        self._reader, self._writer = socket.socketpair()
        self._previous = -1

    def arm(self) -> ExitDeadline:
        self._writer.setblocking(False)  # the C handler must never block on a full socket
        self._previous = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        _fork_state.update(fd=self._writer.fileno(), previous=self._previous)
        _children_forget_the_deadline()
        threading.Thread(target=self._watch, name="dfm-exit-deadline", daemon=True).start()
        return self

    def disarm(self) -> None:
        """Stop watching (main thread), unless a stop signal came: the process must then still end in time."""
        if self.signalled.is_set() or _fork_state["fd"] != self._writer.fileno():
            return
        signal.set_wakeup_fd(self._previous)
        _fork_state.update(fd=-1, previous=-1)
        self._reader.shutdown(socket.SHUT_RDWR)  # the watching thread's recv returns b"" and it ends

    def _watch(self) -> None:
        while data := self._reader.recv(64):
            self._pass_on(data)
            stop = [number for number in data if number in self.signals]
            if stop:
                self.signalled.set()
                self._count_down(signal.Signals(stop[0]).name)
                return

    def _pass_on(self, data: bytes) -> None:
        """Whoever had the wakeup fd before still gets every signal's byte."""
        if self._previous != -1:
            try:
                os.write(self._previous, data)
            except OSError:
                pass

    def _count_down(self, name: str) -> None:
        first = min(DUMP_AFTER_S, self.timeout_s)
        time.sleep(first)
        if first < self.timeout_s:
            dump_stacks(
                f"dfm: {who()} still running {first:.0f} s after {name} (a save may still be finishing); Python "
                f"stacks of every thread follow; it exits {STALL_EXIT_CODE} at {self.timeout_s:g} s "
                "(train.exit_signal_timeout_s) if it has not ended by then"
            )
            time.sleep(self.timeout_s - first)
        dump_stacks(
            f"dfm: {who()} still running {self.timeout_s:.0f} s after {name} "
            f"(train.exit_signal_timeout_s={self.timeout_s:g}); Python stacks of every thread follow, "
            f"then it exits {STALL_EXIT_CODE}"
        )
        os._exit(STALL_EXIT_CODE)


def who() -> str:
    return f"rank {os.environ.get('RANK', '0')} (pid {os.getpid()})"


def _children_forget_the_deadline() -> None:
    """A forked child (a checkpoint writer, a data worker) has no watching thread: its signals' bytes must
    not land in the parent's socket, where a child's SIGTERM would look like the parent's."""
    at_fork_once(after_in_child=_forget)


def _forget() -> None:
    if _fork_state["fd"] != -1:
        signal.set_wakeup_fd(_fork_state["previous"])
        _fork_state.update(fd=-1, previous=-1)
