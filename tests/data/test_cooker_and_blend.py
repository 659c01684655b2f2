"""Reading DFM-style shards, errors that name the shard and key, and blended metadatasets."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import webdataset as wds

from dfm.data.energon.cooker import BadSampleError, cook_diffusion_sample
from dfm.data.energon.data_module import (
    build_train_loader,
    build_val_loader,
    write_blend_metadataset,
)
from dfm.data.energon.task_encoder import sample_metadata
from dfm.data.prepare.energon_prepare import run_energon_prepare
from dfm.data.prepare.synthetic import write_synthetic_dataset
from tests.data.synthetic_data import small_settings


def write_dfm_style_shard(out_dir, drop_part: str | None = None) -> None:
    """As NVIDIA DFM writes them: latent with a leading batch dim, text as a tensor, parts encoded by webdataset."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(out_dir / "dfm-%06d.tar"), maxcount=100, verbose=0) as writer:
        for i in range(6):
            sample = {
                "__key__": f"dfm{i:04d}",
                "pth": torch.randn(1, 4, 1, 8, 8),
                "pickle": torch.randn(5 + i, 16) if i % 2 else np.random.randn(5 + i, 16).astype(np.float32),
                "json": {"caption": f"dfm caption {i}", "image_height": 64, "image_width": 64},
            }
            if drop_part is not None:
                del sample[drop_part]
            writer.write(sample)
    run_energon_prepare(out_dir)


def test_loader_reads_dfm_style_shards(tmp_path):
    write_dfm_style_shard(tmp_path / "dfm")
    batch = next(build_train_loader(small_settings(tmp_path / "dfm"), 0, 1))
    assert batch.latent_shape[0].tolist() == [4, 1, 8, 8]
    assert all(m["caption"].startswith("dfm caption") for m in sample_metadata(batch))


def test_missing_part_names_shard_and_key(tmp_path):
    write_dfm_style_shard(tmp_path / "nopickle", drop_part="pickle")
    with pytest.raises(BadSampleError, match=r"shard .*/nopickle/dfm-000000\.tar, key dfm\d+: missing part '\.pickle'"):
        next(build_train_loader(small_settings(tmp_path / "nopickle"), 0, 1))


def test_cooker_rejects_a_malformed_latent():
    crude = {"__key__": "k1", "pth": torch.zeros(2, 3), "pickle": torch.zeros(3, 4), "json": {"caption": "x"}}
    with pytest.raises(ValueError, match=r"key k1: latent '\.pth' has shape \(2, 3\)"):
        cook_diffusion_sample(crude)


def test_blend_metadataset_mixes_datasets_by_weight(tmp_path, synthetic_dataset, second_synthetic_dataset):
    blend = write_blend_metadataset(
        tmp_path / "blend.yaml", [(synthetic_dataset, 1.0), (second_synthetic_dataset, 1.0)]
    )
    loader = build_train_loader(small_settings(blend), 0, 1)
    keys = [m["key"] for _ in range(12) for m in sample_metadata(next(loader))]
    from_second = sum(k.startswith("b") for k in keys)
    assert 0 < from_second < len(keys)


def test_val_loader_is_one_finite_pass_over_the_val_split(tmp_path):
    from synthetic_data import synthetic_settings

    path = write_synthetic_dataset(
        tmp_path / "split", 24, synthetic_settings(), shard_maxcount=4, split_ratio="0.5,0.5,0"
    )
    val_keys = [m["key"] for batch in build_val_loader(small_settings(path), 0, 1) for m in sample_metadata(batch)]
    train = build_train_loader(small_settings(path), 0, 1)
    train_keys = {m["key"] for _ in range(6) for m in sample_metadata(next(train))}
    assert len(val_keys) == len(set(val_keys)) == 12
    assert not train_keys & set(val_keys)
