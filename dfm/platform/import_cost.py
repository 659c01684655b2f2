"""Start-up cost: megatron-core's fusions compile on their first call, not at import.

``megatron.core.jit`` sets ``jit_fuser = torch.compile`` and megatron's fusion modules decorate
their functions with it at import time. Decorating with ``torch.compile`` imports dynamo and
inductor, ~2 s of CPU in every process (every rank of every launch), although a dfm model calls
none of those fusions on the paths it runs. ``defer_megatron_compile()`` installs an import hook
that, right after ``megatron.core.jit`` runs, swaps ``jit_fuser`` for a decorator that calls
``torch.compile`` on the function's first call: the same compiled function, later.

Nothing changes when megatron-core was imported before dfm (the hook never fires).
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


class _JitFuserFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, name: str, path: Any, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != JIT_MODULE:
            return None
        sys.meta_path.remove(self)  # one module, once: find it the normal way, then step aside
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchAfterExec(spec.loader)
        return spec


def defer_megatron_compile() -> None:
    """Install the hook unless megatron-core's jit module is already imported or hooked."""
    if JIT_MODULE in sys.modules or any(isinstance(finder, _JitFuserFinder) for finder in sys.meta_path):
        return
    sys.meta_path.insert(0, _JitFuserFinder())
