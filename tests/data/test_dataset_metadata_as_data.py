"""A dataset's energon metadata is data: a ``.nv-meta/dataset.yaml`` naming Python (``part_filter:
evil.py:part_filter``, ``sample_loader``, a ``__module__`` outside energon) is refused before energon reads it,
naming the file and the key, and the code never runs (its marker file stays absent); ``dataset.allow_code=true``
lets energon run it (trusted data only). A blend metadataset naming such a folder is refused the same way."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from synthetic_data import small_settings

from dfm.data.energon.data_module import build_train_loader, write_blend_metadataset
from dfm.data.energon.metadata_code import DatasetCodeError
from tests.training.entry import run_entry


def with_code(synthetic_dataset: Path, tmp_path: Path, key: str, value: str) -> tuple[Path, Path, Path]:
    """A copy of the dataset whose dataset.yaml names ``value`` under ``key``; -> (folder, dataset.yaml, marker)."""
    dataset = tmp_path / "dataset"
    shutil.copytree(synthetic_dataset, dataset)
    marker = tmp_path / "code-ran"
    meta = dataset / ".nv-meta"
    (meta / "evil.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
        "def part_filter(part):\n    return True\n"
        "def sample_loader(sample):\n    return sample\n"
    )
    yaml_file = meta / "dataset.yaml"
    yaml_file.write_text(yaml_file.read_text() + f"{key}: {value}\n")
    return dataset, yaml_file, marker


@pytest.mark.slow  # starts training through the entry point on real shards (README: the quick tier leaves those out)
def test_training_refuses_a_part_filter_naming_python(synthetic_dataset, tmp_path):
    """Through the entry point: exit non-zero naming file and key; the code never ran."""
    dataset, yaml_file, marker = with_code(synthetic_dataset, tmp_path, "part_filter", "evil.py:part_filter")
    overrides = [f"dataset.path={dataset}", "dataset.num_workers=0", "train.train_iters=1"]
    result = run_entry(1, [*overrides, f"logger.log_dir={tmp_path / 'logs'}"], mock=False, timeout=300)
    assert result.returncode != 0
    assert f"{yaml_file}: part_filter: 'evil.py:part_filter'" in result.stderr, result.stderr[-3000:]
    assert "dataset.allow_code=true" in result.stderr
    assert not marker.exists(), "the dataset's code ran"


@pytest.mark.parametrize(
    "key, value",
    [
        ("part_filter", "evil.py:part_filter"),
        ("sample_loader", "evil.py:sample_loader"),
        ("sample_type", "{__module__: evil, __class__: Sample}"),
    ],
)
def test_loader_refuses_metadata_naming_code(synthetic_dataset, tmp_path, key, value):
    dataset, yaml_file, marker = with_code(synthetic_dataset, tmp_path, key, value)
    with pytest.raises(DatasetCodeError) as error:
        build_train_loader(small_settings(dataset), dp_rank=0, dp_size=1)
    assert f"{yaml_file}: {key}" in str(error.value)
    assert not marker.exists()


def test_a_blend_naming_such_a_folder_is_refused(synthetic_dataset, tmp_path):
    dataset, yaml_file, marker = with_code(synthetic_dataset, tmp_path, "part_filter", "evil.py:part_filter")
    blend = write_blend_metadataset(tmp_path / "blend.yaml", [(synthetic_dataset, 1.0), (dataset, 1.0)])
    with pytest.raises(DatasetCodeError) as error:
        build_train_loader(small_settings(blend), dp_rank=0, dp_size=1)
    assert f"{yaml_file}: part_filter" in str(error.value)
    assert not marker.exists()


def test_allow_code_lets_energon_run_it_and_plain_metadata_loads(synthetic_dataset, tmp_path):
    next(build_train_loader(small_settings(synthetic_dataset), dp_rank=0, dp_size=1))  # energon's own classes only
    dataset, _, marker = with_code(synthetic_dataset, tmp_path, "part_filter", "evil.py:part_filter")
    next(build_train_loader(small_settings(dataset, allow_code=True), dp_rank=0, dp_size=1))
    assert marker.exists()  # the reference is real: energon ran the file once allowed
