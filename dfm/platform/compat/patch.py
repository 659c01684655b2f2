"""The patch record and its mechanics: resolve the target, check its source, apply, restore.

A ``Patch`` names one attribute of one megatron-core module (``CudaRNGStatesTracker.fork`` in
``megatron.core.tensor_parallel.random``), says in one line why it exists, and lists snippets of
source the patch relies on. Before anything is replaced, the snippets are looked up in
``inspect.getsource`` of the site (the target itself unless ``site`` names another function), so
a megatron-core release that rewrites a patched site fails at start-up naming the patch, instead
of being patched blindly.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import inspect
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

WRITTEN_FOR_MEGATRON_CORE = "0.16.1"
WRITTEN_FOR_TORCH = "2.13"  # the safe-loading patches target torch's distributed checkpoint


class WrittenFor(NamedTuple):
    distribution: str
    version: str  # the version dfm's patches of it were written for
    records: str  # the file that declares those patches


# (module prefix, what its patches were written for): the first match names them in a mismatch's message.
WRITTEN_FOR = (
    ("megatron.energon", WrittenFor("megatron-energon", "7.4.1", "loader_reads.py")),
    ("multistorageclient", WrittenFor("multi-storage-client", "1.3.1", "loader_reads.py")),
    ("megatron.core", WrittenFor("megatron-core", WRITTEN_FOR_MEGATRON_CORE, "registry.py")),
    ("torch", WrittenFor("torch", WRITTEN_FOR_TORCH, "registry.py")),
)


def written_for(module: str) -> WrittenFor:
    """The distribution that holds ``module``, the version dfm's patches of it were written for, and the
    file that declares them."""
    for prefix, target in WRITTEN_FOR:
        if module == prefix or module.startswith(prefix + "."):
            return target
    raise ValueError(f"no entry in WRITTEN_FOR holds {module}")


class _Missing:
    """Stands for an attribute the target does not have (the patch adds it, restore deletes it)."""

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()


class PatchSourceMismatch(RuntimeError):
    """The installed package (megatron-core, energon, ...) no longer has the code a patch was written against."""


class TargetChanged(Exception):
    """Raised by a ``replace`` function whose original is not what it was written for."""


@dataclass(frozen=True)
class Patch:
    """One replaced attribute of a module of megatron-core (or of torch, energon or multistorageclient:
    ``WRITTEN_FOR``).

    ``replace(original)`` builds the new value from the original one (the raw class attribute,
    e.g. a ``classmethod`` object, or ``MISSING``). ``also_bound_in`` lists modules that imported
    the original by name; they get the replacement too. ``cpu_only=False`` marks fixes that are
    needed on every device (megatron without Apex / Transformer Engine).
    """

    name: str
    module: str
    attribute: str
    why: str
    relies_on: tuple[str, ...]
    replace: Callable[[Any], Any]
    site: str | None = None
    also_bound_in: tuple[str, ...] = ()
    cpu_only: bool = True

    @property
    def target(self) -> str:
        return f"{self.module}.{self.attribute}"

    def check_source(self) -> None:
        """Raise PatchSourceMismatch unless every ``relies_on`` snippet is in the site's source."""
        site = f"{self.module}.{self.site or self.attribute}"
        try:
            source = _normalized(inspect.getsource(_resolve(self.module, self.site or self.attribute)))
        except (AttributeError, ImportError, OSError, TypeError) as error:
            raise self._mismatch(f"its site {site} cannot be read ({error})") from error
        for snippet in self.relies_on:
            if _normalized(snippet) not in source:
                raise self._mismatch(f"the source of {site} no longer contains {snippet!r}")

    def apply(self) -> Applied:
        """Check the source, then replace the target (and its by-name aliases); -> how to undo it."""
        self.check_source()
        owner_path, _, name = self.attribute.rpartition(".")
        owner = _resolve(self.module, owner_path)
        original = _raw_attribute(owner, name)
        aliases = tuple(importlib.import_module(module) for module in self.also_bound_in)
        for alias in aliases:
            if getattr(alias, name, MISSING) is not original:
                raise self._mismatch(f"{alias.__name__}.{name} is no longer the same object as {self.target}")
        try:
            replacement = self.replace(original)
        except TargetChanged as error:
            raise self._mismatch(str(error)) from error
        for holder in (owner, *aliases):
            setattr(holder, name, replacement)
        return Applied(self, name, original, replacement, holders=(owner, *aliases))

    def _mismatch(self, problem: str) -> PatchSourceMismatch:
        target = written_for(self.module)
        on_cuda = " (or run on CUDA, where it is not applied)" if self.cpu_only else ""
        return PatchSourceMismatch(
            f"compat patch '{self.name}' (target {self.target}): {problem}. "
            f"The patch was written for {target.distribution} {target.version} (torch {WRITTEN_FOR_TORCH}), "
            f"{importlib.metadata.version(target.distribution)} (torch {torch.__version__}) is installed. "
            f"Re-read the target, then update or drop the patch and its relies_on snippets in "
            f"dfm/platform/compat/{target.records} (docs/device_layer.md){on_cuda}."
        )


@dataclass
class Applied:
    """A patch in effect: enough to put every original back."""

    patch: Patch
    name: str
    original: Any
    replacement: Any
    holders: tuple[Any, ...] = field(default_factory=tuple)

    def restore(self) -> None:
        for holder in self.holders:
            if self.original is MISSING:
                delattr(holder, self.name)
            else:
                setattr(holder, self.name, self.original)


@contextlib.contextmanager
def patches_applied(patches: Sequence[Patch]) -> Iterator[list[Applied]]:
    """Apply ``patches`` in order for the ``with`` block; restore them in reverse order after it."""
    applied = []
    try:
        for patch in patches:
            applied.append(patch.apply())
        yield applied
    finally:
        restore_all(applied)


def restore_all(applied: list[Applied]) -> None:
    """Undo applied patches, newest first (two patches of one module restore in the right order)."""
    while applied:
        applied.pop().restore()


def _resolve(module: str, dotted: str) -> Any:
    target = importlib.import_module(module)
    for part in filter(None, dotted.split(".")):
        target = getattr(target, part)
    return target


def _raw_attribute(owner: Any, name: str) -> Any:
    """A class's own attribute as stored (a classmethod stays a classmethod); MISSING when absent."""
    if inspect.isclass(owner):
        return owner.__dict__.get(name, MISSING)
    return getattr(owner, name, MISSING)


def _normalized(source: str) -> str:
    """Whitespace runs collapsed, so reformatting alone does not fail a check."""
    return re.sub(r"\s+", " ", source)
