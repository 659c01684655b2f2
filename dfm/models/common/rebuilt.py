"""A tensor that autograd would keep is kept as the (smaller, or kept anyway) tensors it is made from.

``through_rebuilt(fn, rebuild, *sources)`` runs ``fn(rebuild(*sources))``; what ``fn`` saves of its
input (any view of it) is kept as ``sources`` and rebuilt (``rebuild(*sources)`` again) when the
backward unpacks it. Used where the input is cheap to rebuild from tensors kept anyway:

* the MLP's activation output (fc2's input) from fc1's output, which the activation's backward keeps
  (``model.recompute_activation``, activation_mlp.py);
* FLUX's output projections' inputs: the joint attention's output gathered in a stream's row order
  (the kernel keeps the output for its own backward), and the single-stream block's
  cat(attention, activation) (flux_layer.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from torch import Tensor

from dfm.platform.torch_api import top_saved_tensors_hooks

Result = TypeVar("Result")


def _storage(tensor: Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


@contextlib.contextmanager
def rebuilt_on_unpack(output: Tensor, sources: tuple[Tensor, ...], rebuild: Callable[..., Tensor]) -> Iterator[None]:
    """Within the block, a saved view of ``output``'s storage (``output = rebuild(*sources)``, laid out
    as ``rebuild`` makes it) is kept as ``sources`` and the same view of ``rebuild(*sources)`` is
    unpacked. Every saved tensor still passes the enclosing saved-tensor hooks (full-layer
    checkpointing, a measurement): they see the sources in place of ``output``."""
    # Nested saved-tensor hooks replace the enclosing ones (no public API composes them): ours call
    # theirs, or full-layer checkpointing would keep the sources alive and a measurement would miss them.
    outer = top_saved_tensors_hooks()
    outer_pack, outer_unpack = outer if outer is not None else (lambda t: t, lambda t: t)
    target = _storage(output) if output.numel() else None  # an empty tensor has no storage of its own

    def pack(tensor: Tensor):
        if _storage(tensor) != target or tensor.dtype != output.dtype:
            return None, outer_pack(tensor)
        view = (tensor.shape, tensor.stride(), tensor.storage_offset() - output.storage_offset())
        return view, tuple(outer_pack(source) for source in sources)

    def unpack(packed) -> Tensor:
        view, value = packed
        if view is None:
            return outer_unpack(value)
        shape, stride, offset = view
        rebuilt = rebuild(*(outer_unpack(source) for source in value))
        return rebuilt.as_strided(shape, stride, rebuilt.storage_offset() + offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def through_rebuilt(fn: Callable[[Tensor], Result], rebuild: Callable[..., Tensor], *sources: Tensor) -> Result:
    """``fn(rebuild(*sources))``, where what ``fn`` saves of its input is kept as ``sources``."""
    output = rebuild(*sources)
    if not torch.is_grad_enabled():
        return fn(output)
    with rebuilt_on_unpack(output, sources, rebuild):
        return fn(output)
