"""Fork hooks registered once per process: ``os.register_at_fork`` keeps every registration, so a hook
registered at each start-up call would run once per call in every child."""

from __future__ import annotations

import os
from collections.abc import Callable

_registered: set[tuple[Callable[[], None] | None, Callable[[], None] | None]] = set()


def at_fork_once(after_in_child: Callable[[], None], before: Callable[[], None] | None = None) -> None:
    """``os.register_at_fork(before=..., after_in_child=...)`` unless this pair is registered already."""
    if (before, after_in_child) in _registered:
        return
    if before is None:
        os.register_at_fork(after_in_child=after_in_child)
    else:
        os.register_at_fork(before=before, after_in_child=after_in_child)
    _registered.add((before, after_in_child))
