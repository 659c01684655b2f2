"""The training loop's objects left out of Python's cyclic garbage collector.

Once a run is built, a process holds ~300k objects that live as long as it does (imported modules,
the model's modules and parameters, the optimizer). The collector's full collection walks every one of
them: 180-265 ms on the 2-core CPU machine (digits-video, measured 2026-11-30), about three steps
of that run. The first full collection comes within tens of steps of the start and lands in whichever
step crosses the collector's allocation threshold; a step that makes more Python objects crosses it
more often. Frozen (``gc.freeze``), those objects are skipped by every later collection, which then
walks only what the steps themselves made (a few thousand objects, well under a millisecond).

Objects freed by reference counting are freed as before; only garbage in reference cycles made before
the freeze waits until ``gc.unfreeze`` when the loop ends (nothing is collected at entry: a full
collection there would cost what the freeze saves).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def setup_objects_frozen() -> Iterator[None]:
    """Within: the objects that exist on entry are not walked by the cyclic collector. Nested or
    inside an outer freeze, the outermost one unfreezes."""
    outer = gc.get_freeze_count() > 0
    gc.freeze()
    try:
        yield
    finally:
        if not outer:
            gc.unfreeze()
