"""The loader patches (dfm/platform/compat/loader_reads.py): energon's open shards keep no tar header after
reading, multistorageclient builds no metric for no instrument, and the loader hands the same packs."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
from megatron.energon.flavors.webdataset.itar import ITarFile
from multistorageclient.providers.base import BaseStorageProvider
from multistorageclient.telemetry import Telemetry

from dfm.data.energon.data_module import build_train_loader
from dfm.platform.compat.loader_reads import LOADER_PATCHES
from dfm.platform.compat.patch import patches_applied
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


@pytest.mark.parametrize("instrumented", [False, True])
def test_storage_metrics_are_built_only_for_an_instrument(monkeypatch, tmp_path, instrumented):
    built = []
    monkeypatch.setattr(BaseStorageProvider, "_build_base_attributes", lambda self, op: built.append(op) or {})
    (tmp_path / "part").write_bytes(b"abc")
    with patches_applied(LOADER_PATCHES):
        from megatron.energon.epathlib import EPath

        with EPath(tmp_path / "part").open("rb") as f:
            provider = f._storage_client._storage_provider
            provider._init_metrics()
            if instrumented:
                gauge = type("Gauge", (), {"set": lambda self, value, attributes=None: None})()
                monkeypatch.setitem(provider._metric_gauges, Telemetry.GaugeName.LATENCY, gauge)
            assert f.read() == b"abc"
    assert bool(built) == instrumented
