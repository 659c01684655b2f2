"""megatron-core on CPU/gloo, and on torch's Adam: a registry of undoable, source-checked patches.

``install()`` applies every patch of ``registry.PATCHES`` once per process: on CUDA only those not
marked ``cpu_only``; ``install_loader_patches()`` the energon ones, when a loader is built.
``uninstall()`` puts every original back. Each patch first checks that the
source it was written against is still there, so a megatron-core upgrade that moves a patched site
fails at start-up naming the patch. Importing this package does not import megatron.
See docs/device_layer.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from dfm.platform.compat.patch import Applied, Patch, PatchSourceMismatch, patches_applied, restore_all

__all__ = [
    "Patch",
    "PatchSourceMismatch",
    "applicable_patches",
    "install",
    "install_loader_patches",
    "installed",
    "is_installed",
    "patches_applied",
    "uninstall",
]

_applied: list[Applied] = []  # the patches in effect in this process, oldest first
_is_installed = False
_loader_patched = False


def applicable_patches() -> tuple[Patch, ...]:
    """The registry's patches this process needs: all of them on CPU, on CUDA the device-independent ones."""
    from dfm.platform.compat.registry import PATCHES

    on_cpu = not torch.cuda.is_available()
    return tuple(patch for patch in PATCHES if on_cpu or not patch.cpu_only)


def install() -> None:
    """Apply the applicable patches; a no-op when already installed.

    Raises PatchSourceMismatch (naming the patch and its target) if megatron-core changed under one;
    the patches applied before it are undone first, so a failed install leaves megatron untouched.
    """
    global _is_installed, _loader_patched
    if _is_installed:
        return
    try:
        for patch in applicable_patches():
            _applied.append(patch.apply())
    except BaseException:
        restore_all(_applied)
        _loader_patched = False
        raise
    _is_installed = True


def install_loader_patches() -> None:
    """Apply ``loader_reads.LOADER_PATCHES`` (energon's) once per process; loader workers forked later inherit them."""
    global _loader_patched
    if _loader_patched:
        return
    from dfm.platform.compat.loader_reads import LOADER_PATCHES

    for patch in LOADER_PATCHES:
        _applied.append(patch.apply())
    _loader_patched = True


def uninstall() -> None:
    """Restore every patched attribute to its original object (the loader patches too); a no-op when
    nothing is installed."""
    global _is_installed, _loader_patched
    restore_all(_applied)
    _is_installed = _loader_patched = False


def is_installed() -> bool:
    return _is_installed


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """``install()`` for the ``with`` block; uninstalls after it unless it was installed before."""
    was_installed = _is_installed
    install()
    try:
        yield
    finally:
        if not was_installed:
            uninstall()
