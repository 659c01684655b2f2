"""Training processes die with their parent: workers with the torchrun agent, and every process a
worker starts (dist_checkpointing's forked writers, their result-queue server, data workers) with
that worker.

Without this, ``kill -9`` of the agent (a job scheduler's last resort) leaves workers training,
holding the accelerator and writing into the checkpoint directory. Two mechanisms: Linux's
``PR_SET_PDEATHSIG`` (the kernel sends SIGKILL when the parent exits) and a watchdog thread that
polls the parent pid (other systems; and children forked from a thread other than the main
one, since the kernel ties the death signal to the forking *thread*).

The processes a worker starts ignore the stop signals (SIGTERM, SIGUSR1): torchrun forwards
SIGTERM to each worker's process group and Slurm signals every process of a job step, and the
checkpoint save the worker then makes needs its writers and their result queue alive. They end
with their worker instead, by the mechanisms above.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.managers
import os
import signal
import sys
import threading
import time

from dfm.platform.fork_hooks import at_fork_once

PR_SET_PDEATHSIG = 1
POLL_SECONDS = 1.0
LAUNCHER_ENV = "TORCHELASTIC_RUN_ID"  # set by torchrun in every worker
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # preemption: the worker saves, its helpers carry on

_fork_state = {"parent": 0, "from_main_thread": True}
_writer_queue: dict = {}  # "manager", "queue": referenced for the process's lifetime (dropping the manager stops it)


def die_with_launcher() -> None:
    """In a torchrun worker: exit when the agent does; in any case, make forked children exit with us.

    A process started without torchrun keeps running when its parent exits (``nohup`` works).
    """
    if LAUNCHER_ENV in os.environ:
        die_with_parent(os.getppid(), kernel_signal=True)
    forked_children_die_with_us()


def forked_children_die_with_us() -> None:
    """Every child this process forks from now on dies with it and ignores the stop signals."""
    at_fork_once(before=_remember_forking_thread, after_in_child=_child_dies_with_parent)


def die_with_parent(parent: int, kernel_signal: bool) -> None:
    """SIGKILL this process when ``parent`` exits (kernel signal where available, plus a polling thread)."""
    if kernel_signal and sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent exited before the signal was armed
        os._exit(1)
    threading.Thread(target=_watch, args=(parent,), name="parent-watch", daemon=True).start()


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_SECONDS)
    os.kill(os.getpid(), signal.SIGKILL)


def _remember_forking_thread() -> None:
    _fork_state["parent"] = os.getpid()
    _fork_state["from_main_thread"] = threading.current_thread() is threading.main_thread()


def _child_dies_with_parent() -> None:
    # The kernel signal fires when the forking thread exits: only arm it for the main thread.
    die_with_parent(_fork_state["parent"], kernel_signal=_fork_state["from_main_thread"])
    ignore_stop_signals()


def ignore_stop_signals() -> None:
    """A helper process outlives the stop signals sent to its whole job (it ends with its parent)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def checkpoint_writer_queue_dies_with_us() -> None:
    """Start the queue server megatron's checkpoint writers report to, armed to die with this process.

    megatron creates it lazily with a *spawned* ``Manager``, which outlives a killed rank, dies from a
    SIGTERM to the rank's process group (the next save then fails with a broken pipe), and re-imports
    the entry script and torch (~3.5 CPU s a rank). dfm's is *forked*, before the rank touches its
    device: the fork hook arms it to die with the rank and to ignore the stop signals. megatron gets it
    through the compat patch ``async-save-results-queue``.
    """
    if _writer_queue:
        return
    forked_children_die_with_us()
    manager = multiprocessing.managers.SyncManager(ctx=multiprocessing.get_context("fork"))
    manager.start()
    _writer_queue.update(manager=manager, queue=manager.Queue())


def writer_results_queue():
    """The queue ``checkpoint_writer_queue_dies_with_us`` started; None before (megatron then makes its own)."""
    return _writer_queue.get("queue")
