"""Saving: check for room, write ``<root>/iter_N`` on all ranks, seal it with a manifest, then
move ``latest`` and prune. A save that fails (disk full, I/O error) removes what it wrote and
leaves ``latest`` where it was.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import torch
from megatron.core import dist_checkpointing, parallel_state

from dfm.checkpoint.collective import barrier, decided_on_rank0, gathered, rank, world_size
from dfm.checkpoint.errors import CheckpointSaveError
from dfm.checkpoint.files import (
    checkpoint_bytes,
    format_bytes,
    iteration_dir,
    mark_latest,
    newest_complete,
    prune_checkpoints,
    read_latest,
    remove_partial,
    room_problem,
)
from dfm.checkpoint.manifest import FileEntry, checkpoint_files, describe_files, verify, write_manifest
from dfm.checkpoint.run_settings import data_kind, dataset_identity
from dfm.checkpoint.state import COMPANIONS, TrainingState, full_sharded_state_dict, layout
from dfm.parallel.fsdp_shards import inner_model

logger = logging.getLogger("dfm.checkpoint")

# Per parameter beyond its own dtype: fp32 master copy (when not fp32) and Adam's two fp32 moments.
OPTIMIZER_BYTES_PER_PARAM = 8


def save_checkpoint(
    root: str,
    iteration: int,
    run: TrainingState,
    config_dict: dict,
    keep_last: int | None = None,
    async_queue=None,
) -> Path:
    """Write ``<root>/iter_N`` on all ranks, then seal it, mark it ``latest`` (rank 0) and prune old ones.

    With ``async_queue`` (megatron's ``AsyncCallsQueue``) the tensors are written by a forked
    process while training goes on; the manifest is written and ``latest`` moves when the queue
    finalizes the save, which it does only once every rank has finished writing.
    """
    target = iteration_dir(root, iteration)
    check_room(root)
    if rank() == 0:
        remove_partial(target)  # a leftover of an interrupted save of this same iteration
        target.mkdir(parents=True)
    barrier()
    state = full_sharded_state_dict(run.model, run.optimizer, run.loader, is_loading=False, ema=run.ema).state
    for name, companion in run.companions.items():
        state[name] = {
            **companion.sharded_state(name, is_loading=False).state,
            "scheduler": companion.scheduler.state_dict(),
        }
    if run.companions:
        state[COMPANIONS] = sorted(run.companions)
    state.update(
        iteration=iteration,
        scheduler=run.scheduler.state_dict(),
        config=config_dict,
        layout=layout(run.model),
        has_ema=run.ema is not None,
        data_kind=data_kind(run.loader),
        dataset_identity=dataset_identity(config_dict.get("dataset", {}).get("path"))
        if data_kind(run.loader) == "energon"
        else None,
    )
    if async_queue is None:
        with failures_named(target):
            dist_checkpointing.save(state, str(target))
        finalize_save(root, iteration, keep_last)
    else:
        with failures_named(target):
            request = dist_checkpointing.save(state, str(target), async_sharded_save=True)
        request.finalize_fns.append(partial(finalize_save, root, iteration, keep_last))
        # the writers' failures arrive in the first finalize step (megatron's): named and cleaned up there too
        request.finalize_fns[:] = [partial(named_step, target, fn) for fn in request.finalize_fns]
        async_queue.schedule_async_request(request)
    return target


def named_step(target: Path, step, *args, **kwargs):
    with failures_named(target):
        return step(*args, **kwargs)


def finalize_save(root: str, iteration: int, keep_last: int | None) -> None:
    """On all ranks, once every rank's files are written: manifest, mark ``latest``, prune, log."""
    target = iteration_dir(root, iteration)
    barrier()
    seal(target)
    if rank() == 0:
        mark_latest(root, iteration)
        for old in prune_checkpoints(root, keep_last, newest=iteration):
            logger.info("removed old checkpoint %s (checkpoint.keep_last=%s)", old, keep_last)
    barrier()
    if rank() == 0:
        logger.info("saved checkpoint %s", target)


def seal(target: Path) -> None:
    """Checksum the files (shared over ranks), write the manifest on rank 0 and check it; else raise."""
    paths = decided_on_rank0(lambda: checkpoint_files(target))
    entries, unreadable = [], []
    for part_entries, part_faults in gathered(describe_share(target, paths[rank() :: world_size()])):
        entries += part_entries
        unreadable += part_faults
    faults = decided_on_rank0(lambda: unreadable or write_and_check(target, entries))
    if faults:
        remove_partial(target)
        raise CheckpointSaveError(
            f"checkpoint {target} is incomplete after writing, so it was removed and 'latest' still names "
            f"{read_latest(target.parent)}: " + "; ".join(faults)
        )


def describe_share(target: Path, paths: list[str]) -> tuple[list[FileEntry], list[str]]:
    try:
        return describe_files(target, paths), []
    except OSError as error:
        return [], [f"reading back {error.filename}: {error}"]


def write_and_check(target: Path, entries: list[FileEntry]) -> list[str]:
    try:
        write_manifest(target, entries)
    except OSError as error:
        return [f"writing its manifest failed: {error}"]
    return verify(target, checksums=False)


@contextlib.contextmanager
def failures_named(target: Path) -> Iterator[None]:
    """A failure while writing ``target`` (an OSError in the rank, or in megatron's writer processes, which
    reach the rank as ``RuntimeError: Worker failure: [Errno 28] ...`` or torch's CheckpointException)
    removes it and is re-raised naming the directory, the error, and the bytes written vs free."""
    try:
        yield
    except CheckpointSaveError:
        raise
    except (KeyboardInterrupt, SystemExit):
        raise  # a stop: the unfinished save is set aside at the next start
    except BaseException as error:  # noqa: BLE001  (torch's CheckpointException is a BaseException)
        written, free = directory_bytes(target), shutil.disk_usage(target.parent).free
        remove_partial(target)
        latest = read_latest(target.parent)
        raise CheckpointSaveError(
            f"saving checkpoint {target} failed: {write_error(error, free)}; it had written {format_bytes(written)} "
            f"when it failed, {format_bytes(shutil.disk_usage(target.parent).free)} are free under "
            f"{target.parent} now{last_size(target.parent)}. The partial directory was removed and "
            + (f"'latest' still names {latest}" if latest is not None else "no 'latest' was written")
        ) from error


FULL_BELOW = 1 << 20  # bytes free when a write failed without an errno (torch's zip writer): the disk was full


def write_error(error: BaseException, free: int) -> str:
    """What went wrong, named: the OSError in the chain (or quoted by a writer process's failure); a failure
    without an errno on a file system left with under 1 MiB free is a full disk; else the error itself."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError):
            return f"{seen.strerror or seen} (errno {seen.errno})"
        seen = seen.__cause__ or seen.__context__
    quoted = re.search(r"\[Errno (\d+)\] ([^\n'\"]+)", str(error))
    if quoted:
        return f"{quoted.group(2).strip()} (errno {quoted.group(1)})"
    detail = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
    if free < FULL_BELOW:
        return f"No space left on device ({format_bytes(free)} free when it failed; {detail})"
    return detail


def directory_bytes(directory: Path) -> int:
    try:
        return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file() and not f.is_symlink())
    except OSError:
        return 0


def last_size(root: Path) -> str:
    last = newest_complete(root)
    return f"; the last checkpoint ({last.name}) took {format_bytes(checkpoint_bytes(last))}" if last else ""


def check_room(root: str | Path) -> None:
    """Refuse to start a save when the file system has less room than the last checkpoint took."""

    def problem() -> str | None:
        last = newest_complete(root)
        if last is None:
            return None
        return room_problem(root, checkpoint_bytes(last), f"the last checkpoint ({last.name})")

    message = decided_on_rank0(problem)
    if message:
        raise CheckpointSaveError(message)


def estimated_checkpoint_bytes(model, ema=None) -> int:
    """Model + optimizer (+ EMA) bytes of the whole run: each rank's share summed, replicas once."""
    local = 0
    for chunk in model:
        for param in inner_model(chunk).parameters():
            param = getattr(param, "orig_param", param)  # Megatron-FSDP: the TP-local parameter
            per_param = param.element_size() + OPTIMIZER_BYTES_PER_PARAM
            per_param += 4 if param.dtype != torch.float32 else 0
            per_param += 4 if ema is not None else 0
            local += param.numel() * per_param
    replicas = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    return sum(gathered(local)) // replicas


def warn_if_little_room(root: str | None, model, ema=None) -> None:
    """At start-up, before the first save of ``root``: warn if the estimate does not fit."""
    if not root:
        return
    estimate = estimated_checkpoint_bytes(model, ema)
    if rank() != 0 or newest_complete(root) is not None:
        return  # once a checkpoint exists, every save compares with its real size
    message = room_problem(root, estimate, f"the model + optimizer state (about {format_bytes(estimate)})")
    if message:
        logger.warning("%s; the first save will likely fail", message)
