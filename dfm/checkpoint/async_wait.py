"""Waiting for an async checkpoint save, bounded: a writer that writes nothing for
``checkpoint.async_save_timeout_s`` is abandoned instead of waited on for ever.

megatron's ``AsyncCallsQueue.maybe_finalize_async_calls(blocking=True)`` joins the forked writer with no
timeout, so a writer that never finishes stops every rank for good (#45: once in 22 runs on a loaded
2-core machine, root cause unknown). Here the ranks poll together: each waits up to 0.5 s for its own
writer to exit, then one all-reduce of (writer alive, writer stuck). Once every rank's writer has exited,
megatron finalizes the save as before. Once a writer has run ``timeout_s`` without a byte added to the
save's folder, every rank abandons that save: the
writers' stacks go to the log, the writers are killed (their own workers die with them,
dfm/platform/parent_watch.py), their results are dropped from the queue, and the unfinished folder is
removed, as a failed save's is (save.py): ``latest`` still names the previous checkpoint and training
goes on. Bytes written count as progress (a large save may take long, but it writes).
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from pathlib import Path

from dfm.checkpoint.collective import barrier, maxima, rank
from dfm.checkpoint.files import read_latest, remove_partial
from dfm.platform.child_stacks import ask_children_for_stacks, live_children
from dfm.platform.watchdog import one_dump_at_a_time

logger = logging.getLogger("dfm.checkpoint")

POLL_S = 0.5
# For a stalled writer to write its stacks before it is killed: it may wait for a core on a loaded machine
# (the default 1 s was once too short in the test suite), and an abandoned save is rare.
STACKS_WAIT_S = 5.0
# megatron's writer forks a worker per file and waits for their reports without a timeout: alive with no
# worker left and nothing written for this long (or the timeout, if shorter), it waits for workers that are
# gone (killed, or dead), and is abandoned then rather than after the whole timeout.
WORKERLESS_S = 60.0


def finish_async_saves(
    saves, target: Path | None, timeout_s: float | None, on_progress: Callable[[], None] = lambda: None
) -> bool:
    """Wait until ``saves`` (megatron's ``AsyncCallsQueue``, one save in flight: the one writing ``target``)
    is finalized -> True, or abandoned (no byte written for ``timeout_s`` on some rank) -> False.
    ``timeout_s`` None or 0: wait as long as it takes. ``on_progress`` runs when the folder grows.
    Every rank must call it (collectives)."""
    size, last_growth = None, time.monotonic()
    last_with_workers = last_growth
    while saves.get_num_unfinalized_calls():
        alive = writer_exited_within(saves, POLL_S) is False
        now = time.monotonic()
        grown = folder_bytes(target)
        if grown != size:
            size, last_growth = grown, now
            on_progress()
        if not (alive and writer_without_workers(saves)):
            last_with_workers = now
        reason = stall_reason(alive, now - last_growth, now - last_with_workers, timeout_s)
        any_alive, any_stuck = agreed(alive, reason is not None)
        if not any_alive:
            saves.maybe_finalize_async_calls(blocking=True)  # every writer has exited: no wait left
        elif any_stuck:
            abandon(saves, target, reason)
            return False
    return True


def stall_reason(alive: bool, idle_s: float, workerless_s: float, timeout_s: float | None) -> str | None:
    """Why this rank's writer counts as stalled (None: it does not): alive, and nothing written for
    ``timeout_s``, or for ``WORKERLESS_S`` (the timeout if shorter) with no worker process left."""
    if not (alive and timeout_s):
        return None
    if idle_s > timeout_s:
        return f"wrote nothing for {timeout_s:g} s (checkpoint.async_save_timeout_s)"
    grace = min(timeout_s, WORKERLESS_S)
    if min(idle_s, workerless_s) > grace:
        return f"has had no worker process and wrote nothing for {grace:g} s (its workers are gone)"
    return None


def writer(saves):
    """This rank's writer process of the oldest in-flight save (None: none was started)."""
    return getattr(saves.async_calls[0].async_caller, "process", None)


def writer_without_workers(saves) -> bool:
    """This rank's writer has no live child process: a dead worker stays a zombie, unreaped by a writer
    that waits for its report (Linux /proc; False where that cannot be known)."""
    process = writer(saves)
    if process is None or not Path(f"/proc/{process.pid}/task").is_dir():
        return False
    return not live_children(process.pid)


def writer_exited_within(saves, seconds: float) -> bool | None:
    """Wait up to ``seconds`` for this rank's writer of the oldest in-flight save -> True once it has
    exited (at once when it already had), False while it runs, None when there is none. The ranks whose
    writers are done go on to the poll's all-reduce and wait there for the others."""
    process = writer(saves)
    if process is None:
        return None
    process.join(seconds)
    return not process.is_alive()


def folder_bytes(target: Path | None) -> int:
    """Bytes of the files under ``target`` so far (0 when absent)."""
    if target is None or not target.is_dir():
        return 0
    total = 0
    for path in target.rglob("*"):
        try:
            if path.is_file() and not path.is_symlink():
                total += path.stat().st_size
        except OSError:  # a file renamed or removed while we look
            continue
    return total


def agreed(alive: bool, stuck: bool) -> tuple[bool, bool]:
    """(some rank's writer is alive, some rank's writer is stuck), the same on every rank."""
    any_alive, any_stuck = maxima([float(alive), float(stuck)])
    return bool(any_alive), bool(any_stuck)


def abandon(saves, target: Path | None, reason: str | None) -> None:
    """Give up the oldest in-flight save on every rank: log the writers' stacks, kill them, forget the
    request (unfinalized), drop what they reported, remove the unfinished folder. ``reason``: why this
    rank's writer stalled (None: another rank's did)."""
    process = writer(saves)
    if process is not None and process.is_alive():
        with one_dump_at_a_time():  # every rank's writer dumps now: whole, one after another, not interleaved
            logger.error(
                "rank %d: the checkpoint writer (pid %d) for %s %s; its stacks follow, then it is stopped",
                rank(),
                process.pid,
                target,
                reason or "is stopped with the save (another rank's writer stalled)",
            )
            ask_children_for_stacks(STACKS_WAIT_S)
        process.kill()
        process.join()
    saves.async_calls.popleft().async_caller.process = None
    drop_reported_results()
    barrier()
    drop_reported_results()  # again: a result a killed writer was handing over may land just after
    if rank() == 0 and target is not None:
        remove_partial(target)
        latest = read_latest(target.parent)
        before = "no checkpoint yet" if latest is None else f"'latest' still names iteration {latest}"
        logger.error("abandoned the save of %s (a writer made no progress): %s; training goes on", target, before)
    barrier()


def drop_reported_results() -> None:
    """Empty this rank's writer-results queue: a writer that finished before the save was abandoned left
    its results there, and the next save would read them as its own."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import _get_write_results_queue

    results = _get_write_results_queue()
    while True:
        try:
            results.get_nowait()
        except queue.Empty:
            return
