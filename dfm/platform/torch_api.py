"""Private torch APIs whose form differs between the torch dfm is developed on (2.13) and older ones
it runs on (the GPU image's 2.11): one call site each, the difference handled here."""

from __future__ import annotations

from collections.abc import Callable

import torch

Hooks = tuple[Callable, Callable]


def top_saved_tensors_hooks() -> Hooks | None:
    """The innermost (pack, unpack) saved-tensor hooks autograd would apply now, or None.

    ``torch._C._autograd._top_saved_tensors_default_hooks`` takes ``ignore_is_tracing`` in newer
    releases and no argument in some older ones (which never hide the hooks while tracing)."""
    top = torch._C._autograd._top_saved_tensors_default_hooks
    try:
        return top(False)
    except TypeError:
        return top()
