"""The loader patch ``energon-tar-headers-forgotten`` (dfm/platform/compat/energon_tar.py): energon's open
shards keep no tar header after reading, and the loader hands the same packs as without the patch."""

from __future__ import annotations

import dataclasses
import gc

import torch
from megatron.energon.flavors.webdataset.itar import ITarFile

from dfm.data.energon.data_module import build_train_loader
from dfm.platform.compat.patch import patches_applied
from dfm.platform.compat.registry import LOADER_PATCHES
from tests.data.synthetic_data import small_settings

PACKS = 30


def read_packs(path) -> tuple[list, int]:
    """PACKS packs of a fresh loader, and the tar headers its open shards hold after them."""
    loader = build_train_loader(small_settings(path), 0, 1)
    packs = [next(loader) for _ in range(PACKS)]
    headers = sum(len(o.members) for o in gc.get_objects() if isinstance(o, ITarFile))
    del loader
    gc.collect()  # its shards closed before the next loader counts its own
    return packs, headers


def test_open_shards_forget_the_headers_they_read(synthetic_dataset):
    plain, plain_headers = read_packs(synthetic_dataset)
    with patches_applied(LOADER_PATCHES):
        patched, patched_headers = read_packs(synthetic_dataset)
    assert plain_headers > PACKS  # what the patch is for: a header per part read, kept
    assert patched_headers == 0
    for a, b in zip(plain, patched, strict=True):
        for field in dataclasses.fields(a):
            x, y = getattr(a, field.name), getattr(b, field.name)
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, field.name
