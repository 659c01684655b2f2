"""Host memory on CPU runs: large tensors go back to the system when freed, small ones are reused.

glibc's malloc serves a request from its heap unless it is at least ``M_MMAP_THRESHOLD`` bytes, and
it raises that threshold to the size of every mmapped block freed (up to 32 MiB). After the first
large tensor is freed, tensors of up to 32 MiB (a transformer block's weights or gradients) come from
the heap, where freed ones stay mapped and fragment it: measured 0.2-0.35 GiB kept per rank of a
0.11B-parameter run, more than a block's weights. So the threshold is fixed: a tensor above 4 MiB
is its own mapping, unmapped when freed. Just above, not at: activations of exactly 4 MiB (power-of-two
shapes such as MovieGen digits' fc1 output [2048, 512] fp32, and its gradient) would otherwise be fresh
mappings every step, 1024 pages faulted in each: the digits-video training run spent 172 against 146 ms
an iteration on them (300 iterations, 2026-11-30; ~800 page faults an iteration fewer, losses identical).

Below that size a mapping per tensor costs more than it saves: every new mapping is zero pages that
fault in on first touch, and a step of a small model allocates thousands of activations of 0.1-4 MiB
(fixed at 128 KiB: ~26,000 page faults a step of the digits-video rung, its steps ~30 % slower). Those come from
the heap, and ``M_TRIM_THRESHOLD`` keeps up to 1 GiB of freed heap mapped for the next step instead
of handing it back after every free (glibc's default once the threshold is fixed: 128 KiB). Only
tensors under 4 MiB live in the heap, so what is kept is at most a step's working set of small
tensors; at 64 MiB the small-4k-mix rung's step (4096 tokens of mixed sizes) still trimmed and regrew
its heap every step: ~58,000 page faults a step, against ~5,500 at 1 GiB and 4 % less CPU time
(2026-11-29). CUDA memory is torch's caching allocator's and unaffected.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = (4 << 20) + (64 << 10)  # above 4 MiB: a 4 MiB tensor comes from the heap
TRIM_THRESHOLD_BYTES = 1 << 30
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def return_freed_memory_promptly(threshold: int = MMAP_THRESHOLD_BYTES, kept: int = TRIM_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes and its trim threshold at ``kept`` bytes for
    this process; True if they were set.

    A no-op (False) without glibc, or when the user set malloc's thresholds (``MALLOC_MMAP_THRESHOLD_``,
    ``MALLOC_TRIM_THRESHOLD_``, ``GLIBC_TUNABLES``) themselves.
    """
    if any(os.environ.get(name) for name in USER_SETTINGS):
        return False
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold)) and bool(libc.mallopt(M_TRIM_THRESHOLD, kept))


def _glibc():
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 -- present in glibc only (musl has mallopt as a stub)
    except (OSError, AttributeError):
        return None
    return libc
