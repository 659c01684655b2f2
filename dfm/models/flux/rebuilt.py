"""A tensor that autograd would keep is kept as the (smaller, or kept anyway) tensors it is made from.

FLUX's output projections read the joint attention's output in the streams' row order (a gather of
the kernel's output, which the kernel keeps for its own backward), and the single-stream block's
``proj_out`` reads cat(attention, activation): kept as they are, the attention output is kept twice
and the activation output again inside the cat. ``rebuilt_on_unpack`` makes autograd keep the
sources instead and rebuild the tensor (one gather / cat, an activation) when the backward unpacks it.

``through_rebuilt(fn, rebuild, *sources)`` runs ``fn(rebuild(*sources))`` so. Like
``dfm.models.common.activation_mlp.recomputed``, but for several sources and for any view of the
output's storage (could move to common with it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from torch import Tensor

Result = TypeVar("Result")


def _storage(tensor: Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


@contextlib.contextmanager
def rebuilt_on_unpack(output: Tensor, sources: tuple[Tensor, ...], rebuild: Callable[..., Tensor]) -> Iterator[None]:
    """Within the block, a saved view of ``output``'s storage (``output = rebuild(*sources)``, contiguous,
    as ``rebuild`` makes it) is kept as ``sources`` and the same view of ``rebuild(*sources)`` is
    unpacked. Every saved tensor still passes the enclosing saved-tensor hooks (full-layer
    checkpointing, a measurement): they see the sources in place of ``output``."""
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
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
