"""megatron's distributed-optimizer collectives on gloo, in place: without gloo's copy of the bucket.

Under the distributed optimizer megatron reduce-scatters each gradient bucket into the rank's chunk
and, after the step, all-gathers the parameter bucket from every rank's chunk, both chunks views of
the bucket; without ``overlap_grad_reduce`` the whole model is one bucket. gloo's
``reduce_scatter_tensor`` and ``all_gather_into_tensor`` copy the whole bucket (measured: +4 bytes a
parameter for fp32 gradients, +2 for bf16 parameters). In place instead:

* reduce-scatter: an all-reduce of the bucket. gloo's reduce-scatter is an all-reduce of its copy,
  so the sums are the same, bit for bit (tests/platform/test_gloo_reduce.py); the rest of the bucket
  holds the reduced sums too instead of this rank's own gradients, and megatron reads only the
  rank's chunk of it before it zeroes the bucket.
* all-gather: each rank broadcasts its chunk into the others' buckets (copies, so exact).

Both run on the process group itself: inside megatron's ``_coalescing_manager`` a ``dist.all_reduce``
would be queued and run as ``allreduce_coalesced``, which flattens (copies) its tensors first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def reduce_scatter_in_place_on_gloo(original):
    """``reduce_scatter_tensor(output, input, op, group, async_op)`` as megatron calls it."""

    def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not _is_own_chunk_on_gloo(output, input, group):
            return original(output, input, op=op, group=group, async_op=async_op)
        options = dist.AllreduceOptions()
        options.reduceOp = op
        _process_group(group).allreduce([input], options).wait()
        return None  # done: with async_op megatron waits on its coalescing manager, which has no work

    return reduce_scatter


def all_gather_in_place_on_gloo(original):
    """``all_gather_into_tensor(output, input, group, async_op)`` as megatron calls it."""

    def all_gather(output, input, group=None, async_op=False):
        if not _is_own_chunk_on_gloo(input, output, group):
            return original(output, input, group=group, async_op=async_op)
        process_group = _process_group(group)
        for owner, chunk in enumerate(output.view(-1).chunk(dist.get_world_size(group))):
            options = dist.BroadcastOptions()
            options.rootRank, options.rootTensor = owner, 0
            process_group.broadcast([chunk], options).wait()
        return None

    return all_gather


def _process_group(group):
    return group if group is not None else dist.distributed_c10d._get_default_group()


def _is_own_chunk_on_gloo(chunk: torch.Tensor, whole: torch.Tensor, group) -> bool:
    """The collective runs on gloo and ``chunk`` is this rank's chunk of ``whole`` (one storage)."""
    if dist.get_backend(group) != "gloo" or not (chunk.is_contiguous() and whole.is_contiguous()):
        return False
    if whole.numel() != chunk.numel() * dist.get_world_size(group) or whole.dtype != chunk.dtype:
        return False
    start = whole.data_ptr() + dist.get_rank(group) * chunk.numel() * chunk.element_size()
    same_storage = chunk.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
    return same_storage and chunk.data_ptr() == start
