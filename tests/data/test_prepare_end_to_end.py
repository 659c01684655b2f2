"""Raw folder (real photos, generated mp4s, every caption format, a corrupt file) -> preparation with
tiny random encoders -> energon prepare -> loader of PackedBatches carrying the right captions."""

from __future__ import annotations

import io
import json
import pickle
import tarfile
from pathlib import Path

import torch
import webdataset as wds

from dfm.data.energon.data_module import EnergonDataSettings, build_train_loader
from dfm.data.energon.task_encoder import PackingSettings, sample_metadata


def read_shard_samples(dataset_dir: Path) -> dict[str, dict]:
    samples = {}
    for sample in wds.WebDataset([str(p) for p in sorted(dataset_dir.glob("*.tar"))], shardshuffle=False):
        samples[sample["__key__"]] = sample
    return samples


def test_corrupt_file_is_reported_and_skipped(example_dataset):
    skipped = [Path(path).relative_to(example_dataset.raw_dir).as_posix() for path, _ in example_dataset.report.skipped]
    assert skipped == example_dataset.corrupt_files
    assert example_dataset.report.written == len(example_dataset.captions)
    report_file = json.loads((example_dataset.dataset_dir / "prepare_report.rank0.json").read_text())
    assert len(report_file["skipped"]) == 1


def test_every_readable_file_is_in_the_shards_with_its_caption(example_dataset):
    samples = read_shard_samples(example_dataset.dataset_dir)
    metadata = {json.loads(s["json"])["source_path"]: json.loads(s["json"]) for s in samples.values()}
    assert {path: m["caption"] for path, m in metadata.items()} == example_dataset.captions
    sources = {m["caption_source"] for m in metadata.values()}
    assert sources == {"sidecar", "jsonl", "meta_json", "filename"}
    assert all(m["tiny_random_encoders"] for m in metadata.values())


def test_shard_parts_follow_the_dfm_layout(example_dataset):
    for key, sample in read_shard_samples(example_dataset.dataset_dir).items():
        meta = json.loads(sample["json"])
        latent = torch.load(io.BytesIO(sample["pth"]))
        text = pickle.loads(sample["pickle"])
        assert latent.dim() == 4 and list(latent.shape) == meta["latent_shape"], key
        assert text.ndim == 2 and text.shape[0] == meta["text_len"], key
        # Buckets are multiples of patch (2) x VAE factor (8) and fit the pixel budget.
        assert meta["bucket_height"] % 16 == 0 and meta["bucket_width"] % 16 == 0
        assert meta["bucket_height"] * meta["bucket_width"] <= 64 * 64
        expected_frames = 1 if meta["media_type"] == "image" else 1 + (meta["num_frames"] - 1) // 4
        assert latent.shape[1] == expected_frames


def test_no_partial_shards_are_left(example_dataset):
    assert not list(example_dataset.dataset_dir.glob("*.partial"))
    with tarfile.open(sorted(example_dataset.dataset_dir.glob("*.tar"))[0]) as tar:
        names = tar.getnames()
    assert {Path(n).suffix for n in names} == {".pth", ".pickle", ".json"}


def test_loader_yields_packs_with_the_right_captions(example_dataset):
    settings = EnergonDataSettings(
        path=str(example_dataset.dataset_dir),
        packing=PackingSettings(seq_length=256, max_text_len=64),
        packing_buffer_size=8,
        num_workers=0,
        shuffle_buffer_size=4,
    )
    loader = build_train_loader(settings, dp_rank=0, dp_size=1)
    seen = set()
    for _ in range(4):
        batch = next(loader)
        assert batch.seq_len <= 256
        assert batch.num_samples == len(sample_metadata(batch))
        for meta, shape in zip(sample_metadata(batch), batch.latent_shape.tolist()):
            assert meta["caption"] == example_dataset.captions[meta["source_path"]]
            assert shape == meta["latent_shape"]
            seen.add(meta["source_path"])
    assert seen == set(example_dataset.captions)
