"""Gradients accumulated by autograd straight into megatron's grad buffer, with no Python hook per parameter.

Megatron's DDP registers a Python hook on each parameter's AccumulateGrad node that adds ``param.grad``
into ``param.main_grad`` (its view of the bucket buffer) and drops ``param.grad``. Without overlapped
reduction that add is all it does, and autograd can do it itself: with ``param.grad`` set to the
``main_grad`` view before the backward, AccumulateGrad adds each new gradient into it in place. Same
sums, one C++ add per parameter instead of a Python call and an add (~16 us each on the CPU:
docs/performance.md). Megatron reads ``main_grad`` afterwards as before.

Only where it is the same computation: megatron DDP chunks (not Megatron-FSDP) without overlapped
reduction or fused weight-gradient accumulation (whose kernels write main_grad themselves and hand
autograd a placeholder), and parameters whose ``main_grad`` has their dtype and device (fp32 training;
a bf16 parameter's fp32 main_grad cannot be its ``.grad``). Other parameters keep megatron's hook.

On a one-process job megatron's grad sync is an all-reduce of each bucket over a group of one (its
scaling factor 1.0): it changes nothing and costs a gloo round trip a step (~1.6 % of a digits-video
step, docs/performance.md). ``skip_sync_alone`` drops it there.
"""

from __future__ import annotations

import torch

from dfm.platform.distributed import alone

_MEGATRON_HOOK = "_make_backward_post_hook"


def accumulate_into_buffers(chunk, ddp_config, tconfig) -> list[torch.nn.Parameter]:
    """Removes megatron's grad hook from the parameters of ``chunk`` (a megatron DDP module) that
    qualify, and returns them: ``arm`` them before each backward."""
    if ddp_config.overlap_grad_reduce or getattr(tconfig, "gradient_accumulation_fusion", False):
        return []
    params = [p for p in chunk.module.parameters() if p.requires_grad and _same_layout(p)]
    return [p for p in params if _drop_megatron_hook(p)]


def _same_layout(param: torch.nn.Parameter) -> bool:
    grad = getattr(param, "main_grad", None)
    return grad is not None and grad.dtype == param.dtype and grad.device == param.device


def _drop_megatron_hook(param: torch.nn.Parameter) -> bool:
    """Removes the hook megatron put on ``param``'s AccumulateGrad node; False when none is found."""
    node = param.expand_as(param).grad_fn.next_functions[0][0]
    probe = node.register_hook(lambda *_: None)  # its handle reaches the node's hook dict
    hooks = probe.hooks_dict_ref()
    probe.remove()
    if hooks is None:
        return False
    megatron = [key for key, fn in hooks.items() if _MEGATRON_HOOK in getattr(fn, "__qualname__", "")]
    for key in megatron:
        del hooks[key]
    return len(megatron) == 1


def skip_sync_alone(chunk) -> None:
    """On a one-process job, ``chunk`` (megatron DDP) skips its grad sync: nothing to reduce."""
    if alone():
        chunk.finish_grad_sync = _nothing_to_reduce


def _nothing_to_reduce(*args, **kwargs) -> None:
    return None


def arm(params: list[torch.nn.Parameter]) -> None:
    """``param.grad`` = its ``main_grad`` view (zeroed by ``zero_grad_buffer``), for the next backward."""
    for param in params:
        param.grad = param.main_grad
