"""Forked children of a training process run torch single-threaded.

megatron's async checkpoint save forks the rank for every save (``TemporalAsyncCaller``: the child
writes the staged tensors). A child forked after the parent ran OpenMP-parallel torch ops hangs for
ever in its first parallel op of its own: GNU OpenMP's thread pool does not survive ``fork`` (the
pool's threads are not in the child; tests/platform/test_fork_safety.py: a 4M-element elementwise op
in such a child never returns). One thread in the child never enters the pool. This was a candidate
for the async-save stall seen once in 22 runs on a loaded 2-core machine, but not shown to be it: with
this hook removed, a tiny run's six async saves at OMP_NUM_THREADS=2 all finished (the writer did not
enter a parallel region), so that stall is still not root-caused. Data loader workers already run
single-threaded (torch's worker loop).
"""

from __future__ import annotations

import torch

from dfm.platform.fork_hooks import at_fork_once


def forked_children_single_threaded() -> None:
    """Register (once per process) a fork hook that sets torch's CPU threads to 1 in every child."""
    at_fork_once(after_in_child=_one_thread)


def _one_thread() -> None:
    torch.set_num_threads(1)
