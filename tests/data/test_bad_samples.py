"""Bad samples are caught when cooked, named by shard path and key with what is wrong; with
skip_bad_samples they are skipped, counted and named once in the log."""

from __future__ import annotations

import logging

import pytest
import torch
import webdataset as wds
from megatron.energon import SourceInfo

from dfm.config import build_config
from dfm.data.energon.cooker import BadSampleError, CookedDiffusionSample
from dfm.data.energon.data_module import EnergonDataSettings, build_train_loader
from dfm.data.energon.sample_checks import check_cooked_sample
from dfm.data.energon.task_encoder import PackingSettings
from dfm.data.prepare.energon_prepare import run_energon_prepare

CHANNELS, WIDTH = 4, 16


def cooked(latent: torch.Tensor, text: torch.Tensor) -> CookedDiffusionSample:
    source = SourceInfo(dataset_path="/data/set", index=3, shard_name="part-000001.tar", file_names=())
    return CookedDiffusionSample(
        __key__="clip0042",
        __restore_key__=(),
        __subflavors__=None,
        __sources__=(source,),
        latent=latent,
        text_embeddings=text,
        metadata={},
    )


@pytest.mark.parametrize(
    "latent, text, problem",
    [
        (torch.zeros(8, 1, 4, 4), torch.zeros(5, WIDTH), r"8 channels, expected model\.in_channels=4"),
        (torch.zeros(4, 1, 4, 4), torch.zeros(5, 32), r"32 wide, expected model\.text_embed_dim=16"),
        (torch.full((4, 1, 4, 4), float("nan")), torch.zeros(5, WIDTH), r"latent '\.pth' holds 64 non-finite"),
        (torch.zeros(4, 1, 4, 4), torch.tensor([[float("inf")] * WIDTH]), r"text embeddings .* holds 16 non-finite"),
    ],
)
def test_checks_name_shard_key_and_the_mismatch(latent, text, problem):
    with pytest.raises(BadSampleError, match=rf"shard /data/set/part-000001\.tar, key clip0042: .*{problem}"):
        check_cooked_sample(cooked(latent, text), CHANNELS, WIDTH)


def good_sample(i: int) -> dict:
    return {"pth": torch.randn(CHANNELS, 1, 8, 8), "pickle": torch.randn(6, WIDTH), "json": {"caption": f"c{i}"}}


BAD = {
    "bad-channels": {"pth": torch.randn(CHANNELS + 1, 1, 8, 8)},
    "bad-width": {"pickle": torch.randn(6, WIDTH + 2)},
    "bad-nan": {"pth": torch.full((CHANNELS, 1, 8, 8), float("nan"))},
    "bad-rank": {"pth": torch.randn(2, CHANNELS, 1, 8, 8)},
    "bad-decode": {"pth": b"not a torch file"},
}


@pytest.fixture(scope="module")
def dataset_with_bad_samples(tmp_path_factory):
    out = tmp_path_factory.mktemp("bad")
    with wds.ShardWriter(str(out / "mixed-%06d.tar"), maxcount=100, verbose=0) as writer:
        for i in range(12):
            writer.write({"__key__": f"good{i:02d}", **good_sample(i)})
        for key, parts in BAD.items():
            writer.write({"__key__": key, **good_sample(0), **parts})
    run_energon_prepare(out)
    return out


def settings(path, skip: bool, num_workers: int = 0) -> EnergonDataSettings:
    packing = PackingSettings(seq_length=64, in_channels=CHANNELS, text_embed_dim=WIDTH)
    return EnergonDataSettings(
        path=str(path),
        packing=packing,
        packing_buffer_size=4,
        num_workers=num_workers,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        skip_bad_samples=skip,
    )


def test_a_bad_sample_stops_the_run_with_its_name(dataset_with_bad_samples):
    loader = build_train_loader(settings(dataset_with_bad_samples, skip=False), 0, 1)
    with pytest.raises(BadSampleError, match=rf"shard {dataset_with_bad_samples}/mixed-000000\.tar, key bad-"):
        for _ in range(20):
            next(loader)


def test_bad_samples_are_skipped_counted_and_named_once(dataset_with_bad_samples, caplog):
    loader = build_train_loader(settings(dataset_with_bad_samples, skip=True), 0, 1)
    with caplog.at_level(logging.WARNING, logger="dfm.data.energon.task_encoder"):
        keys = [m["key"] for _ in range(16) for m in next(loader).sample_metadata]  # over an epoch
    assert not [k for k in keys if k.startswith("bad")] and {f"good{i:02d}" for i in range(12)} <= set(keys)
    assert loader.skipped_bad_samples == len(BAD)
    for key in BAD:
        assert sum(f"key {key}:" in r.getMessage() for r in caplog.records) == 1, key


def test_bad_samples_are_counted_across_worker_processes(dataset_with_bad_samples):
    loader = build_train_loader(settings(dataset_with_bad_samples, skip=True, num_workers=1), 0, 1)
    for _ in range(16):
        next(loader)
    assert loader.skipped_bad_samples == len(BAD)


def test_skip_bad_samples_is_a_training_config_key():
    cfg = build_config("dit", None, ["dataset.skip_bad_samples=true", "dataset.packing_balance=tokens"])
    assert cfg.dataset.skip_bad_samples is True and cfg.dataset.packing_balance == "tokens"
