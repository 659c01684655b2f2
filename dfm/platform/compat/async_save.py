"""megatron's asynchronous checkpoint save: its writers report to the queue dfm started.

megatron's forked checkpoint writers report to a queue whose server megatron spawns lazily
(``filesystem_async._get_write_results_queue``). dfm starts that server itself, armed to die with
the rank and to outlive the stop signals (``dfm.platform.parent_watch``); this patch hands megatron
dfm's queue instead of writing megatron's private ``_results_queue``.
"""

from __future__ import annotations

import functools

from dfm.platform.compat.patch import TargetChanged


def dfm_queue_first(original):
    """``_get_write_results_queue`` that returns the queue ``parent_watch.checkpoint_writer_queue_dies_with_us``
    started, or megatron's own when dfm started none."""
    if not callable(original):
        raise TargetChanged(f"_get_write_results_queue is {original!r}, not a function")

    @functools.wraps(original)
    def results_queue():
        from dfm.platform.parent_watch import writer_results_queue

        queue = writer_results_queue()
        return original() if queue is None else queue

    return results_queue
