"""Megatron-FSDP with a frozen base.

Megatron-FSDP (megatron-core 0.16.1) keeps frozen parameters in their own group without gradient
buffers, but registers a post-accumulate-grad hook on every parameter, which torch refuses for one
that does not require grad. A frozen parameter never accumulates a gradient: its hook is nothing.
"""

from __future__ import annotations

from collections import OrderedDict

from torch.utils.hooks import RemovableHandle

from dfm.platform.compat.devices import tensor_method_replaced


def _trainable_only(original):
    def register(tensor, hook):
        return original(tensor, hook) if tensor.requires_grad else RemovableHandle(OrderedDict())

    return register


def frozen_params_without_grad_hooks():
    """For the ``with`` block: grad-accumulation hooks are registered on trainable parameters only."""
    return tensor_method_replaced("register_post_accumulate_grad_hook", _trainable_only)
