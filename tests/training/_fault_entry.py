"""The real entry point with a fault injected (tests only), chosen by DFM_TEST_FAULT:

- ``kill_during_save:RANK:ITER[:WHEN]``: that rank SIGKILLs itself inside the save of ITER; WHEN is
  ``before_write`` (nothing written yet), ``after_write`` (the default: its shards written, the save
  not complete on all ranks) or ``before_latest`` (manifest sealed, ``latest`` not moved yet).
- ``enospc_during_save:ITER``: the save of ITER fails with ENOSPC (disk full) after writing its files.
- ``nonfinite_loss:ITER,ITER,...``: the loss of those iterations is NaN.
- ``slow_save:ITER:SECONDS``: the save of ITER prints ``slow save of iter_N writing`` to stderr, then
  waits SECONDS before writing (sync saves: in the rank; async saves: in the forked writer), so that
  a test can signal the job while that save is in flight.
- ``dead_write_worker:ITER[:GRACE_S]``: in the async save of ITER, the worker processes megatron's writer
  forks to write the files SIGKILL themselves before writing (as the OOM killer would end one): megatron's
  writer then waits for their report for ever. GRACE_S, if given, replaces dfm's ``WORKERLESS_S`` (how long
  a writer with no worker left may write nothing before it is abandoned), so a test need not wait 60 s.
"""

import errno
import functools
import os
import runpy
import signal
import sys
from pathlib import Path

import torch

ENTRY = Path(__file__).resolve().parents[2] / "examples" / "megatron" / "recipes" / "dit" / "pretrain_dit_model.py"


def kill_during_save(rank: int, iteration: int, when: str = "after_write") -> None:
    from megatron.core import dist_checkpointing

    from dfm.checkpoint import save as checkpoint_save

    def kill_here(directory) -> None:
        if torch.distributed.get_rank() == rank and str(directory).endswith(f"iter_{iteration:07d}"):
            os.kill(os.getpid(), signal.SIGKILL)

    real_save, real_mark_latest = dist_checkpointing.save, checkpoint_save.mark_latest

    def save(state, directory, *args, **kwargs):
        if when == "before_write":
            kill_here(directory)
        result = real_save(state, directory, *args, **kwargs)
        if when == "after_write":
            kill_here(directory)
        return result

    def mark_latest(root, at_iteration):
        if when == "before_latest":
            kill_here(Path(root) / f"iter_{at_iteration:07d}")
        return real_mark_latest(root, at_iteration)

    dist_checkpointing.save = save
    checkpoint_save.mark_latest = mark_latest


def enospc_during_save(iteration: int) -> None:
    from megatron.core import dist_checkpointing

    real_save = dist_checkpointing.save

    def save(state, directory, *args, **kwargs):
        result = real_save(state, directory, *args, **kwargs)
        if str(directory).endswith(f"iter_{iteration:07d}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))
        return result

    dist_checkpointing.save = save


def slow_save(iteration: int, seconds: float) -> None:
    import time

    from megatron.core import dist_checkpointing

    real_save = dist_checkpointing.save

    def slowly(write, *args, **kwargs):
        print(f"slow save of iter_{iteration:07d} writing", file=sys.stderr, flush=True)
        time.sleep(seconds)
        return write(*args, **kwargs) if write is not None else None

    def save(state, directory, *args, **kwargs):
        if not str(directory).endswith(f"iter_{iteration:07d}"):
            return real_save(state, directory, *args, **kwargs)
        if not kwargs.get("async_sharded_save"):
            return slowly(real_save, state, directory, *args, **kwargs)
        request = real_save(state, directory, *args, **kwargs)
        return request._replace(async_fn=functools.partial(slowly, request.async_fn))

    dist_checkpointing.save = save


def dead_write_worker(iteration: int, grace_s: float | None = None) -> None:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from dfm.checkpoint import async_wait

    if grace_s is not None:
        async_wait.WORKERLESS_S = grace_s

    real_write = FileSystemWriterAsync.write_preloaded_data

    def write_or_die(transform_list, local_proc_idx, write_bucket, *args, **kwargs):
        if f"iter_{iteration:07d}" in str(write_bucket[0]):
            print(f"write worker of iter_{iteration:07d} dies", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return real_write(transform_list, local_proc_idx, write_bucket, *args, **kwargs)

    FileSystemWriterAsync.write_preloaded_data = staticmethod(write_or_die)


def nonfinite_loss(iterations: set[int]) -> None:
    from dfm.training.forward_step import DiffusionForwardStep

    real_loss = DiffusionForwardStep.loss

    def loss(self, *args):
        value, stats = real_loss(self, *args)
        if self.iteration in iterations:
            value = value * float("nan")
            stats = {"loss_and_tokens": stats["loss_and_tokens"] * float("nan")}
        return value, stats

    DiffusionForwardStep.loss = loss


def main() -> None:
    kind, _, arg = os.environ["DFM_TEST_FAULT"].partition(":")
    if kind == "kill_during_save":
        rank, iteration, *when = arg.split(":")
        kill_during_save(int(rank), int(iteration), *when)
    elif kind == "enospc_during_save":
        enospc_during_save(int(arg))
    elif kind == "slow_save":
        iteration, seconds = arg.split(":")
        slow_save(int(iteration), float(seconds))
    elif kind == "dead_write_worker":
        iteration, _, grace = arg.partition(":")
        dead_write_worker(int(iteration), float(grace) if grace else None)
    elif kind == "nonfinite_loss":
        nonfinite_loss({int(i) for i in arg.split(",")})
    else:
        raise ValueError(f"unknown DFM_TEST_FAULT {kind!r}")
    sys.argv = [str(ENTRY), *sys.argv[1:]]
    runpy.run_path(str(ENTRY), run_name="__main__")


if __name__ == "__main__":
    main()
