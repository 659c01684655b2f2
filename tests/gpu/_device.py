"""Where the GPU tests run: CUDA, or the CPU when ``DFM_GPU_TESTS_ON_CPU=1`` rehearses them.

The rehearsal proves a test's plumbing before device time is spent on it (``scripts/gpu/lease.sh``
with ``DFM_GPU_DRYRUN=1``); CI never sets it, so without CUDA these tests are skipped there.
Parts that only exist on CUDA (sync debug mode, the varlen flash kernel) stay skipped on the CPU.
"""

from __future__ import annotations

import os

import pytest
import torch

REHEARSAL = os.environ.get("DFM_GPU_TESTS_ON_CPU") == "1"
ON_CUDA = torch.cuda.is_available() and not REHEARSAL
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")

# Every module of tests/gpu: ``pytestmark = GPU``.
GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (ON_CUDA or REHEARSAL), reason="needs a CUDA GPU (DFM_GPU_TESTS_ON_CPU=1 rehearses on CPU)"),
]


def gpu_test(test):
    """``GPU``'s marks on one test, for a module that also holds plain CPU tests."""
    for mark in GPU:
        test = mark(test)
    return test


cuda_only = pytest.mark.skipif(not ON_CUDA, reason="CUDA-only path (not rehearsed on the CPU)")


def subprocess_env() -> dict[str, str]:
    """Environment additions for entry-point runs: a rehearsal hides any GPU from them."""
    return {"CUDA_VISIBLE_DEVICES": ""} if REHEARSAL else {}
