"""Preparation never mixes runs: a fresh folder or --overwrite, --resume without duplicates, a record
that says whether it completed, and loaders that refuse what is not a finished energon dataset."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from dfm.data.energon.cooker import BadSampleError
from dfm.data.energon.data_module import EnergonDataSettings, build_train_loader
from dfm.data.energon.task_encoder import PackingSettings
from dfm.data.prepare import pipeline
from dfm.data.prepare.energon_prepare import run_energon_prepare
from dfm.data.prepare.pipeline import PrepareSettings, prepare_dataset
from dfm.data.prepare.record import read_preparation_status
from dfm.data.prepare.synthetic import write_synthetic_dataset
from tests.training.entry import RECIPE_DIR

NUM_IMAGES = 7


@pytest.fixture(scope="module")
def raw_dir(tmp_path_factory) -> Path:
    raw = tmp_path_factory.mktemp("raw")
    rng = np.random.default_rng(0)
    for i in range(NUM_IMAGES):
        Image.fromarray(rng.integers(0, 255, (24 + 8 * i, 32, 3), dtype=np.uint8)).save(raw / f"img_{i}.png")
    return raw


def settings(raw_dir: Path, out: Path, **overrides) -> PrepareSettings:
    values = dict(
        input_dir=str(raw_dir),
        output_dir=str(out),
        max_pixels=32 * 32,
        tiny_random_encoders=True,
        vae_kind="kl",
        max_text_len=16,
        shard_maxcount=2,
    )
    return PrepareSettings(**{**values, **overrides})


def shard_keys(out: Path) -> list[str]:
    urls = [str(p) for p in sorted(out.glob("*.tar"))]
    return sorted(s["__key__"] for s in wds.WebDataset(urls, shardshuffle=False))


def interrupt_after(monkeypatch, calls: int) -> None:
    encode = pipeline.encode_file
    count = iter(range(10_000))

    def encode_or_die(*args, **kwargs):
        if next(count) == calls:
            raise KeyboardInterrupt  # as Ctrl-C or a killed job: not a skippable file error
        return encode(*args, **kwargs)

    monkeypatch.setattr(pipeline, "encode_file", encode_or_die)


@pytest.fixture(scope="module")
def interrupted(raw_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("interrupted")
    with pytest.MonkeyPatch.context() as monkeypatch:
        interrupt_after(monkeypatch, 5)
        with pytest.raises(KeyboardInterrupt):
            prepare_dataset(settings(raw_dir, out))
    return out


def test_an_interrupted_preparation_is_recorded_as_unfinished(interrupted):
    status = read_preparation_status(interrupted)
    assert status is not None and not status.complete
    assert len(status.records[0].shards) == 2 and not list(interrupted.glob("*.partial"))
    with pytest.raises(RuntimeError, match=r"did not complete .*--resume"):
        run_energon_prepare(interrupted)


def test_a_non_empty_folder_is_refused(interrupted, raw_dir):
    with pytest.raises(FileExistsError, match=r"not empty \(.*rank000-000000\.tar.*--overwrite.*--resume"):
        prepare_dataset(settings(raw_dir, interrupted))


def test_resume_finishes_without_duplicates(interrupted, raw_dir, tmp_path):
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    for path in interrupted.iterdir():  # a copy: the module's fixture stays interrupted
        if path.is_file():
            (resumed / path.name).write_bytes(path.read_bytes())
    report = prepare_dataset(settings(raw_dir, resumed, resume=True, run_energon_prepare=True))
    keys = shard_keys(resumed)
    assert keys == [f"{i:08d}" for i in range(NUM_IMAGES)] and report.written == NUM_IMAGES
    assert read_preparation_status(resumed).complete and (resumed / ".nv-meta" / "dataset.yaml").is_file()
    with pytest.raises(ValueError, match=r"other settings .*shard_maxcount: 2 -> 3"):
        prepare_dataset(settings(raw_dir, resumed, resume=True, shard_maxcount=3))


def test_overwrite_clears_the_previous_shards_and_index(raw_dir, tmp_path):
    out = tmp_path / "out"
    (out / ".nv-meta").mkdir(parents=True)
    (out / "rank000-000042.tar").write_bytes(b"old")
    report = prepare_dataset(settings(raw_dir, out, overwrite=True, shard_maxcount=4))
    assert report.written == NUM_IMAGES and shard_keys(out) == [f"{i:08d}" for i in range(NUM_IMAGES)]
    assert not (out / ".nv-meta").exists() and not (out / "rank000-000042.tar").exists()
    record = json.loads((out / ".dfm_prepare.rank000.json").read_text())
    assert record["status"] == "complete" and record["written"] == NUM_IMAGES and record["args"]["shard_maxcount"] == 4


def test_overwrite_refuses_a_folder_with_foreign_files_naming_them(raw_dir, tmp_path):
    """Through prepare_energon_dataset.py: the user's backup.tar and notes are named, and nothing is deleted."""
    out = tmp_path / "out"
    (out / ".nv-meta").mkdir(parents=True)
    files = {"rank000-000042.tar": b"old", "backup.tar": b"the user's own", "notes.txt": b"kept"}
    for name, data in files.items():
        (out / name).write_bytes(data)
    script = importlib.util.spec_from_file_location("prepare", RECIPE_DIR / "prepare_energon_dataset.py")
    module = importlib.util.module_from_spec(script)
    script.loader.exec_module(module)
    args = ["--input_dir", str(raw_dir), "--output_dir", str(out), "--tiny_random_encoders", "--overwrite"]
    with pytest.raises(FileExistsError) as error:
        module.main([*args, "--max_pixels", "1024", "--vae_kind", "kl"])
    assert f"{out} holds files a preparation does not write: backup.tar, notes.txt" in str(error.value)
    assert {name: (out / name).read_bytes() for name in files} == files and (out / ".nv-meta").is_dir()


def loader_settings(path) -> EnergonDataSettings:
    return EnergonDataSettings(path=str(path), packing=PackingSettings(seq_length=160), num_workers=0)


def test_loader_names_a_folder_that_is_not_an_energon_dataset(interrupted):
    with pytest.raises(FileNotFoundError, match=r"not an energon dataset.*energon prepare .*--run_energon_prepare"):
        build_train_loader(loader_settings(interrupted), 0, 1)


def test_loader_refuses_an_unfinished_preparation(interrupted, tmp_path):
    (tmp_path / ".nv-meta").mkdir()
    (tmp_path / ".nv-meta" / "dataset.yaml").write_text("__class__: CrudeWebdataset\n")
    (tmp_path / ".dfm_prepare.rank000.json").write_text((interrupted / ".dfm_prepare.rank000.json").read_text())
    with pytest.raises(RuntimeError, match=r"did not complete"):
        build_train_loader(loader_settings(tmp_path), 0, 1)


def test_a_truncated_shard_is_named_with_its_first_lost_key(tmp_path):
    from synthetic_data import synthetic_settings

    out = write_synthetic_dataset(tmp_path / "cut", 12, synthetic_settings(), shard_maxcount=6)
    shard = out / "synthetic-000001.tar"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
    with pytest.raises(BadSampleError, match=rf"shard {shard}, key 0000000\d: the shard is truncated"):
        build_train_loader(loader_settings(out), 0, 1)


@pytest.fixture(scope="module")
def twenty_images(tmp_path_factory) -> Path:
    raw = tmp_path_factory.mktemp("twenty")
    rng = np.random.default_rng(1)
    for i in range(20):
        Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(raw / f"img_{i:02d}.png")
    return raw


def test_an_encoder_failure_stops_the_run_and_resume_retries_the_file(twenty_images, tmp_path, monkeypatch, capsys):
    from test_prepare_units import load_script

    from dfm.data.encoders.vae import VideoVAE

    script = load_script("prepare_energon_dataset")
    argv = ["--input_dir", str(twenty_images), "--output_dir", str(tmp_path), "--max_pixels", "256"]
    argv += ["--tiny_random_encoders", "--vae_kind", "kl", "--max_text_len", "8", "--shard_maxcount", "3"]
    encode, calls = VideoVAE.encode, iter(range(100))

    def out_of_memory_on_the_eighth_file(self, video):
        if next(calls) == 7:
            raise RuntimeError("CUDA out of memory (injected)")
        return encode(self, video)

    monkeypatch.setattr(VideoVAE, "encode", out_of_memory_on_the_eighth_file)
    assert script.main(argv) == 1
    assert (
        f"{twenty_images / 'img_07.png'}: encoding failed (RuntimeError: CUDA out of memory" in capsys.readouterr().err
    )
    status = read_preparation_status(tmp_path)
    assert not status.complete and not status.records[0].skipped and status.records[0].written == 6  # 2 shards
    monkeypatch.setattr(VideoVAE, "encode", encode)  # the failure is gone
    assert script.main([*argv, "--resume"]) == 0
    assert shard_keys(tmp_path) == [f"{i:08d}" for i in range(20)]  # each once: nothing lost, nothing twice
    assert read_preparation_status(tmp_path).complete
