"""megatron's tensor-parallel RNG tracker on the CPU generator.

On CPU the tracker's "CUDA" states are swapped in and out of the CPU default generator (the module
view answers ``torch.cuda.get_rng_state`` / ``manual_seed`` with it). Two sites need more than that.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

FORK_WARNING = "CPU RNG state changed within GPU RNG context"


def set_cpu_rng_state(original):
    """Replaces ``_set_cuda_rng_state``: its body is CUDA generator plumbing (``default_generators``,
    ``_lazy_call``) with no CPU part to keep, so the CPU generator is set directly."""

    def _set_cuda_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    return _set_cuda_rng_state


class _DropMessage(logging.Filter):
    def __init__(self, message: str):
        super().__init__()
        self.message = message

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != self.message


def fork_without_cpu_state_warning(original):
    """Wraps ``CudaRNGStatesTracker.fork``: on CPU the tracked generator *is* the CPU generator, so
    fork's "CPU RNG state changed" warning would fire on every dropout and init under TP. The
    original fork runs unchanged with that one message filtered from its logger."""
    logger = logging.getLogger(original.__module__)

    @functools.wraps(original)
    @contextlib.contextmanager
    def fork(self, *args, **kwargs):
        silence = _DropMessage(FORK_WARNING)
        logger.addFilter(silence)
        try:
            with original(self, *args, **kwargs):
                yield
        finally:
            logger.removeFilter(silence)

    return fork
