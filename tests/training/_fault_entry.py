"""The real entry point with a fault injected (tests only), chosen by DFM_TEST_FAULT:

- ``kill_during_save:RANK:ITER``: that rank SIGKILLs itself inside the save of ITER, after
  writing its shards and before the save completes on all ranks.
- ``enospc_during_save:ITER``: the save of ITER fails with ENOSPC (disk full) after writing its files.
- ``nonfinite_loss:ITER,ITER,...``: the loss of those iterations is NaN.
"""

import errno
import os
import runpy
import signal
import sys
from pathlib import Path

import torch

ENTRY = Path(__file__).resolve().parents[2] / "examples" / "megatron" / "recipes" / "dit" / "pretrain_dit_model.py"


def kill_during_save(rank: int, iteration: int) -> None:
    from megatron.core import dist_checkpointing

    real_save = dist_checkpointing.save

    def save(state, directory, *args, **kwargs):
        result = real_save(state, directory, *args, **kwargs)
        if torch.distributed.get_rank() == rank and str(directory).endswith(f"iter_{iteration:07d}"):
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    dist_checkpointing.save = save


def enospc_during_save(iteration: int) -> None:
    from megatron.core import dist_checkpointing

    real_save = dist_checkpointing.save

    def save(state, directory, *args, **kwargs):
        result = real_save(state, directory, *args, **kwargs)
        if str(directory).endswith(f"iter_{iteration:07d}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))
        return result

    dist_checkpointing.save = save


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
        rank, iteration = arg.split(":")
        kill_during_save(int(rank), int(iteration))
    elif kind == "enospc_during_save":
        enospc_during_save(int(arg))
    elif kind == "nonfinite_loss":
        nonfinite_loss({int(i) for i in arg.split(",")})
    else:
        raise ValueError(f"unknown DFM_TEST_FAULT {kind!r}")
    sys.argv = [str(ENTRY), *sys.argv[1:]]
    runpy.run_path(str(ENTRY), run_name="__main__")


if __name__ == "__main__":
    main()
