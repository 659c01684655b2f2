"""``dataset.cooked_cache_mib``: the loader keeps decoded, checked samples and hands back bitwise the
packs it hands without the cache, over several epochs; the cache stops growing at its limit."""

from __future__ import annotations

import dataclasses

import torch

from dfm.data.energon.cooked_cache import CookedSampleCache, tensor_bytes
from dfm.data.energon.cooker import CookedDiffusionSample
from dfm.data.energon.data_module import build_train_loader
from dfm.data.energon.task_encoder import sample_metadata
from tests.data.conftest import SYNTHETIC_SAMPLES
from tests.data.synthetic_data import small_settings

PACKS = 60  # ~4 samples a pack: over two epochs of the 96 synthetic samples


def packs(path, cache_mib: int) -> list:
    loader = build_train_loader(small_settings(path, cooked_cache_mib=cache_mib), 0, 1)
    return [next(loader) for _ in range(PACKS)]


def test_cached_loader_hands_the_same_packs_over_epochs(synthetic_dataset):
    # Mutation checked by hand: CookedSampleCache.get handing back another key's sample fails this.
    plain, cached = packs(synthetic_dataset, 0), packs(synthetic_dataset, 64)
    assert sum(len(sample_metadata(p)) for p in plain) > 2 * SYNTHETIC_SAMPLES  # the cache is hit
    for a, b in zip(plain, cached):
        assert sample_metadata(a) == sample_metadata(b)
        for field in dataclasses.fields(a):
            x, y = getattr(a, field.name), getattr(b, field.name)
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, field.name


def cooked(key: str, elements: int) -> tuple[dict, CookedDiffusionSample]:
    sample = CookedDiffusionSample(
        __key__=key,
        __restore_key__=("read", key),
        latent=torch.zeros(elements),
        text_embeddings=torch.zeros(1, 1),
        metadata={},
    )
    return {"__key__": key, "__restore_key__": ("read again", key)}, sample


def test_the_cache_stops_at_its_limit_and_hits_carry_the_new_restore_key():
    crude, sample = cooked("a", 100)
    cache = CookedSampleCache(limit_bytes=tensor_bytes(sample) + 10)
    cache.put(crude, sample)
    hit = cache.get(crude)
    assert hit is not sample and hit.latent is sample.latent and hit.__restore_key__ == ("read again", "a")
    other_crude, other = cooked("b", 100)
    cache.put(other_crude, other)  # over the limit: not kept
    assert cache.get(other_crude) is None and cache.held_bytes == tensor_bytes(sample)
    assert CookedSampleCache(limit_bytes=0).get(crude) is None
