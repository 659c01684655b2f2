"""Megatron-FSDP (``megatron.core.distributed.fsdp``) on CPU/gloo.

Megatron-FSDP builds its device meshes with a ``device_type="cuda"`` literal, names its device
``torch.device(f"cuda:{torch.cuda.current_device()}")`` and checks uneven DTensor shards with a
``.cuda()`` copy. On a CPU-only machine each of these becomes "the CPU" for its call only.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from dfm.platform.compat.devices import cpu_if_cuda, cpu_torch_view, running_inside, tensor_method_replaced
from dfm.platform.compat.patch import MISSING, TargetChanged


def cpu_device(*args, **kwargs) -> torch.device:
    """``torch.device`` where every CUDA spelling (``"cuda"``, ``"cuda:cpu"``, ``("cuda", 0)``) is the CPU."""
    if args and isinstance(args[0], str) and args[0].startswith("cuda"):
        return torch.device("cpu")
    return cpu_if_cuda(torch.device(*args, **kwargs))


def cpu_device_torch_view(original: Any):
    """The CPU view of torch (``devices.cpu_torch_view``) whose ``torch.device`` maps CUDA names to
    the CPU too: ``f"cuda:{torch.cuda.current_device()}"`` reads ``"cuda:cpu"`` there."""
    return cpu_torch_view(original, device=cpu_device)


class CpuDeviceMesh:
    """Stands for ``torch.distributed.DeviceMesh`` in a module that builds meshes on ``"cuda"``."""

    def __init__(self, mesh_class):
        self._mesh_class = mesh_class

    def from_group(self, group, device_type, *args, **kwargs):
        return self._mesh_class.from_group(group, "cpu", *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._mesh_class, name)


def meshes_on_cpu(original):
    """Replace a module's global ``DeviceMesh`` with one whose ``from_group`` builds CPU meshes."""
    if not isinstance(original, type) or not hasattr(original, "from_group"):
        raise TargetChanged(f"the module's global 'DeviceMesh' is {original!r}, not torch's DeviceMesh class")
    return CpuDeviceMesh(original)


def _stay_on_cpu(original):
    def stay(tensor, *args, **kwargs):
        return tensor if tensor.device.type == "cpu" else original(tensor, *args, **kwargs)

    return stay


def cuda_copies_stay_on_cpu():
    """``Tensor.cuda()`` returns the CPU tensor itself for the ``with`` block."""
    return tensor_method_replaced("cuda", _stay_on_cpu)


def without_cuda_copies(original):
    """Wrap a function so its ``.cuda()`` copies stay on the CPU."""
    return running_inside(cuda_copies_stay_on_cpu, original)


class MissingTELinear:
    """What no module is: stands for Transformer Engine's TELinear when TE is not installed."""


def te_linear_or_placeholder(original):
    """Without Transformer Engine megatron's ``TELinear`` is built on a MagicMock and is no class,
    so ``isinstance(module, (TELinear,))`` raises; a placeholder class answers False instead."""
    return original if isinstance(original, type) else MissingTELinear


def forward_through_root_hooks(original):
    """``MegatronFSDP.forward`` that calls the root module (``self.module(...)``) instead of its
    ``forward``, so the hooks MegatronFSDP registered on the root run, above all the one that
    starts the backward (``_root_pre_backward``: marks every gradient "to be handled" and queues
    the final reduction).

    The original bypasses the root's hooks; megatron-core 0.16.1 also hangs that hook on the root's
    last-registered submodule (the loop variable left over from ``named_modules()``), and only that
    one fired. When that submodule's output gets its gradient late in the backward (Wan's
    ``time_proj``, after the blocks and the head), the gradients already reduce-scattered are
    marked unhandled again; at the end of the backward megatron zeroes their slots in the still
    allocated bucket and reduce-scatters it again, so the slots of the parameters reached after
    the hook (Wan's ``t_embedder``, ``time_proj``) were added twice or more (2x on gloo).
    """
    if not callable(original):
        raise TargetChanged(f"MegatronFSDP.forward is {original!r}, not a function")

    def forward(self, *inputs, **kwargs):
        self._replace_param_with_raw_if_needed()
        with torch.autograd.profiler.record_function("CustomFSDP.forward"):
            return self.module(*inputs, **kwargs)

    return forward


def stand_in_parameters(original):
    """Adds ``MegatronFSDP.stand_in_parameters(shapes)``: a context manager in which the module holds
    its raw (non-DTensor) parameters, each with zero-memory data of the TP-local shape
    ``shapes[name]``, and FSDP's state-dict pre-hook swaps nothing in. dfm's checkpoint builds its
    sharded-state-dict templates in it (``dfm.checkpoint.fsdp_state``): megatron reads the shapes from
    the module's parameters, whose buckets FSDP frees between steps. After it the raw parameters
    hold their own data again."""
    if original is not MISSING:
        raise TargetChanged(f"MegatronFSDP already has an attribute 'stand_in_parameters' ({original!r})")

    @contextlib.contextmanager
    def stand_in(self, shapes: dict[str, torch.Size]):
        self._replace_param_with_raw_if_needed()
        raw = dict(self.module.named_parameters())
        kept = {name: raw[name].data for name in shapes}
        self.is_param_fsdp_distributed = True  # "already distributed": the pre-hook returns at once
        try:
            for name, shape in shapes.items():
                raw[name].data = torch.empty((1,) * len(shape), dtype=raw[name].dtype).expand(shape)
            yield
        finally:
            for name, data in kept.items():
                raw[name].data = data
            self.is_param_fsdp_distributed = False

    return stand_in
