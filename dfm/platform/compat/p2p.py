"""megatron's batched pipeline point-to-point on gloo: sends that do not block, one tag per direction.

Two things go wrong on gloo, both with PP=2, where the previous and the next stage are one rank:

* megatron ``wait()``s on every request, sends included. On NCCL that only orders the stream; on
  gloo it blocks the CPU until the peer has posted the matching receive. In the interleaved
  schedule the last stage sends a gradient shape and waits on it before it posts the receive for
  the activation the first stage is sending, while the first stage waits on that activation send
  before it reaches its receives: a deadlock. Here sends are handed back already "done" and their
  real requests waited when the schedule returns, by which time the peer has posted every receive.
* Both directions use tag 0 in one process group, and megatron posts send_prev before send_next
  but recv_prev before recv_next; gloo pairs a peer's messages of one tag in posting order. With
  one peer on both sides a gradient can land in an activation's receive. Each direction gets its
  own tag here, so messages pair up in schedule order per direction.

megatron's ``_batched_p2p_ops`` and ``P2PCommunicator._communicate_shapes`` run unchanged: they are
wrapped to announce which directions their ops are, and the module's ``torch.distributed`` is seen
through an overlay whose ``batch_isend_irecv`` posts them with those tags and defers the sends.
"""

from __future__ import annotations

import functools

import torch

from dfm.platform.compat.devices import Overlay, cpu_torch_view

# Activations (and their shapes) go send_next -> recv_prev, gradients send_prev -> recv_next.
FORWARD_TAG, BACKWARD_TAG = 1, 2
# The direction of each op in the order megatron builds them: send_prev, recv_prev, send_next, recv_next.
_TAGS_IN_MEGATRON_ORDER = (BACKWARD_TAG, FORWARD_TAG, FORWARD_TAG, BACKWARD_TAG)


class DeferredSend:
    """A send as megatron waits on it: already done (the real request is waited later)."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


class GlooPointToPoint:
    """The tags of the next batch of ops and the sends not yet waited, for this process."""

    def __init__(self):
        self.next_tags: list[int] = []
        self.pending_sends: list[tuple] = []  # (request, storage): the storage lives until the send is waited

    def announce(self, send_prev: bool, recv_prev: bool, send_next: bool, recv_next: bool) -> None:
        """Record which of megatron's four ops the next batch holds (their tags, in megatron's order)."""
        present = (send_prev, recv_prev, send_next, recv_next)
        self.next_tags = [tag for tag, used in zip(_TAGS_IN_MEGATRON_ORDER, present) if used]

    def batch_isend_irecv(self, ops: list) -> list:
        """Post each op with its direction's tag; hand sends back as done and keep their requests."""
        tags, self.next_tags = self.next_tags, []
        if len(tags) != len(ops):
            raise RuntimeError(
                f"gloo p2p: megatron batched {len(ops)} ops but announced {len(tags)}; megatron's "
                f"p2p call sites changed, re-check dfm/platform/compat/p2p.py against them"
            )
        requests = []
        for op, tag in zip(ops, tags):
            request = op.op(op.tensor, op.peer, group=op.group, tag=tag)
            if op.op is torch.distributed.isend:
                self.pending_sends.append((request, op.tensor.untyped_storage()))
                request = DeferredSend()
            requests.append(request)
        return requests

    def wait_for_sends(self) -> None:
        while self.pending_sends:
            self.pending_sends.pop(0)[0].wait()


GLOO_P2P = GlooPointToPoint()


def gloo_torch_view(original):
    """The p2p module's ``torch``: the CPU view, with the tagging, non-blocking batch_isend_irecv."""
    distributed = Overlay(torch.distributed, batch_isend_irecv=GLOO_P2P.batch_isend_irecv)
    return cpu_torch_view(original, distributed=distributed)


def announcing_batched_ops(original):
    """Wraps ``_batched_p2p_ops`` (keyword-only tensors) to announce the directions of its ops."""

    @functools.wraps(original)
    def batched_p2p_ops(*, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, **kwargs):
        tensors = dict(
            tensor_send_prev=tensor_send_prev,
            tensor_recv_prev=tensor_recv_prev,
            tensor_send_next=tensor_send_next,
            tensor_recv_next=tensor_recv_next,
        )
        GLOO_P2P.announce(*(tensor is not None for tensor in tensors.values()))
        return original(**tensors, **kwargs)

    return batched_p2p_ops


def announcing_shapes(original):
    """Wraps ``P2PCommunicator._communicate_shapes`` to announce the directions of its ops."""

    @functools.wraps(original)
    def communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        GLOO_P2P.announce(tensor_send_prev is not None, recv_prev, tensor_send_next is not None, recv_next)
        return original(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next)

    return communicate_shapes


def waiting_for_sends(schedule):
    """Wraps a pipelined schedule: its deferred sends are waited when it returns."""

    @functools.wraps(schedule)
    def run(*args, **kwargs):
        result = schedule(*args, **kwargs)
        GLOO_P2P.wait_for_sends()
        return result

    return run
