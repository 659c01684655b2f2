"""A per-module view of torch whose CUDA namespace and tensor factories answer for the CPU.

Most of megatron-core's CUDA assumptions are "the current device": ``device=torch.cuda.current_device()``,
``device="cuda"`` literals, ``torch.cuda.Stream`` / ``Event``, the CUDA RNG. Replacing the global
``torch`` of such a module by ``cpu_torch_view(torch)`` fixes all of them at once, while torch itself and
every other module stay untouched.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from dfm.platform.compat.patch import TargetChanged

_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "empty_like", "zeros_like")


def cpu_if_cuda(device):
    """Map any CUDA device spelling (``"cuda"``, ``"cuda:1"``, ``0``, torch.device) to CPU."""
    if device is None:
        return None
    if isinstance(device, int) or torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


class NoOpStream:
    """Stands in for torch.cuda.Stream and torch.cuda.Event: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else NoOpStream()

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class CpuCudaNamespace:
    """What ``torch.cuda`` means inside a viewed megatron module on a CPU-only machine."""

    Stream = NoOpStream
    Event = NoOpStream

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def is_available():
        return False

    @staticmethod
    def current_device():
        return torch.device("cpu")

    @staticmethod
    def device_count():
        return 0

    @staticmethod
    def stream(stream=None):
        return contextlib.nullcontext()

    @staticmethod
    def current_stream(device=None):
        return NoOpStream()

    default_stream = current_stream

    @staticmethod
    def synchronize(device=None):
        pass

    @staticmethod
    def get_rng_state(device="cuda"):
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(new_state, device="cuda"):
        torch.set_rng_state(new_state)

    @staticmethod
    def manual_seed(seed):
        torch.manual_seed(seed)

    @property
    def random(self):
        return self  # torch.cuda.random.get_rng_state(...) -> the CPU generator


def _cpu_factory(factory):
    """Wrap a tensor factory so ``device="cuda"`` (a literal at several sites) means CPU."""

    def on_cpu(*args, device=None, **kwargs):
        return factory(*args, device=cpu_if_cuda(device), **kwargs)

    on_cpu.__name__ = factory.__name__
    return on_cpu


class Overlay:
    """A module seen through a lens: the ``overrides`` replace its attributes, the rest is the module's."""

    def __init__(self, base: Any, **overrides: Any):
        self._base = base
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        return getattr(self._base, name)


def cpu_torch_view(original: Any, **overrides: Any) -> Overlay:
    """The replacement of a module's global ``torch``: torch, except that ``cuda``, the tensor
    factories and any ``overrides`` answer for the CPU."""
    if original is not torch:
        raise TargetChanged(f"the module's global 'torch' is {original!r}, not the torch module")
    factories = {name: _cpu_factory(getattr(torch, name)) for name in _FACTORIES}
    return Overlay(torch, cuda=CpuCudaNamespace(), **factories, **overrides)


@contextlib.contextmanager
def tensor_method_replaced(name: str, make: Callable[[Any], Any]) -> Iterator[None]:
    """``torch.Tensor.<name>`` is ``make(original)`` for the ``with`` block."""
    original = getattr(torch.Tensor, name)
    setattr(torch.Tensor, name, make(original))
    try:
        yield
    finally:
        setattr(torch.Tensor, name, original)


def running_inside(context: Callable[[], Any], original):
    """``original`` (a function or a classmethod) wrapped to run inside ``context()``."""
    if isinstance(original, classmethod):
        return classmethod(running_inside(context, original.__func__))

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        with context():
            return original(*args, **kwargs)

    return wrapped
