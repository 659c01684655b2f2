"""A faster interpreter exit for the entry points.

At exit Python runs one last cyclic garbage collection over every object, which with
torch + megatron-core imported costs ~1.2 s per process (measured on the 2-core CPU
machine; more than a tiny training run itself). Freezing the heap first leaves those
objects to the operating system; finalizers driven by reference counts, atexit handlers
and file flushes still run as usual.
"""

from __future__ import annotations

import atexit
import gc


def skip_final_gc_at_exit() -> None:
    """Register (once per process) a ``gc.freeze`` to run at interpreter exit."""
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
