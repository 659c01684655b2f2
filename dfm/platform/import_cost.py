"""Start-up cost: what megatron-core imports but a dfm process may never use is paid for on first use.

``megatron.core.jit`` sets ``jit_fuser = torch.compile`` and megatron's fusion modules decorate
their functions with it at import time. Decorating with ``torch.compile`` imports dynamo and
inductor, ~2 s of CPU in every process (every rank of every launch), although a dfm model calls
none of those fusions on the paths it runs. ``defer_start_up_imports()`` installs an import hook
that, right after ``megatron.core.jit`` runs, swaps ``jit_fuser`` for a decorator that calls
``torch.compile`` on the function's first call: the same compiled function, later.

megatron-core also imports wandb (its timers and inference context, ~1 s of CPU) whether or not a
run logs to W&B, and multistorageclient (~0.4 s) for object-store checkpoints. The same hook gives
``import wandb`` a module whose code runs on its first attribute access (``wandb.init`` when
``logger.wandb_project`` is set); likewise multistorageclient (energon's paths use it at once).
``importlib.util.LazyLoader`` cannot serve: on Python 3.11 a second ``import wandb`` reads the
module's ``__spec__``, which loads it.

boto3 comes the same way: megatron's timers import TensorBoard, whose file layer imports boto3 for
``s3://`` paths (~0.35 s: s3transfer, urllib3); it runs when an S3 path is first opened.

Nothing changes for a module imported before dfm (the hook never sees it).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

JIT_MODULE = "megatron.core.jit"
RUN_ON_FIRST_USE = ("wandb", "multistorageclient", "boto3")


def compile_on_first_call(function: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile(function)``, built when the function is first called."""
    compiled: Callable[..., Any] | None = None

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if compiled is None:
            import torch

            compiled = torch.compile(function)
        return compiled(*args, **kwargs)

    return call


class _PatchAfterExec(importlib.abc.Loader):
    """Runs the module with its own loader, then points its ``jit_fuser`` at the deferred one."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        if getattr(module, "jit_fuser", None) is _torch_compile():
            module.jit_fuser = compile_on_first_call


def _torch_compile() -> Any:
    torch = sys.modules.get("torch")
    return getattr(torch, "compile", None)


class _RunsOnFirstUse(ModuleType):
    """A module whose code has not run yet: the first missing attribute runs it, in this object."""

    def __getattr__(self, name: str) -> Any:
        loader = self.__dict__.pop("__deferred_loader__", None)
        if loader is None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        if "__deferred_path__" in self.__dict__:
            self.__path__ = self.__dict__.pop("__deferred_path__")
        self.__class__ = ModuleType
        loader.exec_module(self)
        return getattr(self, name)


class _DeferExec(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return _RunsOnFirstUse(spec.name)

    def exec_module(self, module: ModuleType) -> None:
        module.__dict__["__deferred_loader__"] = self.loader
        if "__path__" in module.__dict__:  # importing a submodule first reads __path__: that runs the package
            module.__dict__["__deferred_path__"] = module.__dict__.pop("__path__")


class _StartUpFinder(importlib.abc.MetaPathFinder):
    """Hands out the wrapped loaders above; steps aside once every module it serves is found."""

    def __init__(self) -> None:
        self.waiting = {JIT_MODULE: _PatchAfterExec, **dict.fromkeys(RUN_ON_FIRST_USE, _DeferExec)}

    def find_spec(
        self, name: str, path: Any, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        wrap = self.waiting.pop(name, None)
        if wrap is None:
            return None
        if not self.waiting:
            sys.meta_path.remove(self)
        spec = _find_without(self, name)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = wrap(spec.loader)
        return spec


def _find_without(finder: importlib.abc.MetaPathFinder, name: str) -> importlib.machinery.ModuleSpec | None:
    """The spec the other finders give ``name`` (this finder must not answer its own query)."""
    present = finder in sys.meta_path
    if present:
        sys.meta_path.remove(finder)
    try:
        return importlib.util.find_spec(name)
    finally:
        if present:
            sys.meta_path.insert(0, finder)


def defer_start_up_imports() -> None:
    """Install the hook for whichever of its modules is not imported yet (once per process)."""
    if any(isinstance(finder, _StartUpFinder) for finder in sys.meta_path):
        return
    finder = _StartUpFinder()
    for name in list(finder.waiting):
        if name in sys.modules:
            del finder.waiting[name]
    if finder.waiting:
        sys.meta_path.insert(0, finder)
