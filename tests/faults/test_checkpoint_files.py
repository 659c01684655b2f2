"""The checkpoint protocol on real files, in-process: manifest faults, the verify CLI, which
checkpoint a root resumes, unfinished saves set aside, pruning, the free-space check, and the
architecture comparison."""

from __future__ import annotations

import ast
import logging
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata

from dfm.checkpoint.__main__ import main as verify_cli
from dfm.checkpoint.compare import model_differences
from dfm.checkpoint.errors import CheckpointError
from dfm.checkpoint.files import (
    candidates,
    iteration_dir,
    mark_latest,
    prune_checkpoints,
    room_problem,
    set_aside_partial_saves,
)
from dfm.checkpoint.manifest import MANIFEST, REQUIRED, checkpoint_files, describe_files, verify, write_manifest
from dfm.checkpoint.select import choose_checkpoint
from dfm.config.container import ModelConfig

DFM = Path(__file__).resolve().parents[2] / "dfm"


def write_checkpoint(root: Path, iteration: int, sealed: bool = True, latest: bool = True) -> Path:
    """A checkpoint directory with dist_checkpointing's file names and (if ``sealed``) a manifest."""
    directory = iteration_dir(root, iteration)
    directory.mkdir(parents=True)
    for name in (*REQUIRED, "__0_0.distcp"):
        (directory / name).write_bytes(bytes(range(256)) * (iteration + 1))
    # verify reads .metadata and common.pt as data (dfm.checkpoint.pickle_check): real ones
    torch.save({"iteration": iteration, "pad": bytes(range(256)) * iteration}, directory / "common.pt")
    (directory / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={}, storage_data={})))
    if sealed:
        write_manifest(directory, describe_files(directory, checkpoint_files(directory)))
    if latest:
        mark_latest(root, iteration)
    return directory


@pytest.fixture
def root(tmp_path) -> Path:
    for iteration in (2, 4):
        write_checkpoint(tmp_path, iteration)
    return tmp_path


def test_manifest_names_a_truncated_changed_or_missing_file(root):
    shard = iteration_dir(root, 4) / "__0_0.distcp"
    assert verify(shard.parent) == []
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:100])
    assert verify(shard.parent) == [f"{shard}: 100 bytes, manifest expects {size} (truncated or rewritten)"]
    shard.write_bytes(bytes(size))
    assert "checksum" in verify(shard.parent)[0] and "(corrupted)" in verify(shard.parent)[0]
    shard.unlink()
    assert verify(shard.parent) == [f"{shard}: missing (manifest lists {size} bytes)"]


def test_verify_cli_prints_one_line_per_checkpoint(root, capsys):
    assert verify_cli(["verify", str(root)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{iteration_dir(root, 4)}: ok", f"{iteration_dir(root, 2)}: ok"]
    (iteration_dir(root, 4) / "common.pt").unlink()
    assert verify_cli(["verify", str(iteration_dir(root, 4))]) == 1
    assert "DAMAGED" in capsys.readouterr().out


def test_root_resumes_from_the_newest_checkpoint_that_verifies(root, caplog):
    (iteration_dir(root, 4) / "__0_0.distcp").unlink()
    with caplog.at_level(logging.WARNING, logger="dfm.checkpoint"):
        assert choose_checkpoint(root) == iteration_dir(root, 2)
    assert f"skipping checkpoint {iteration_dir(root, 4)}" in caplog.text and "__0_0.distcp: missing" in caplog.text


def test_a_named_damaged_checkpoint_stops_the_run(root):
    (iteration_dir(root, 4) / "common.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"iter_0000004 cannot be loaded: .*common\.pt: 1 bytes, manifest"):
        choose_checkpoint(iteration_dir(root, 4))


def test_checkpoints_without_manifest_load_with_a_warning(root, caplog):
    (iteration_dir(root, 4) / MANIFEST).unlink()
    with caplog.at_level(logging.WARNING, logger="dfm.checkpoint"):
        assert choose_checkpoint(root) == iteration_dir(root, 4)
    assert "has no manifest" in caplog.text


def test_an_unfinished_save_is_set_aside_and_the_root_starts_from_scratch(tmp_path, caplog):
    partial = tmp_path / "iter_0000005"
    partial.mkdir()
    (partial / "common.pt").touch()
    assert choose_checkpoint(tmp_path) is None
    with caplog.at_level(logging.WARNING, logger="dfm.checkpoint"):
        (moved,) = set_aside_partial_saves(tmp_path)
    assert moved.name.startswith("iter_0000005.partial-") and not partial.exists()
    assert "a save that did not finish" in caplog.text
    assert candidates(tmp_path) == []


def test_statuses_of_a_root(root):
    write_checkpoint(root, 6, sealed=False, latest=False)  # killed before its manifest
    write_checkpoint(root, 8, latest=False)  # killed between the manifest and 'latest'
    mark_latest(root, 4)
    assert [(c.iteration, c.status) for c in candidates(root)] == [
        (8, "newer than latest"),
        (6, "partial"),
        (4, "complete"),
        (2, "complete"),
    ]


def test_prune_keeps_the_newest_and_only_deletes_older_complete_checkpoints(root):
    write_checkpoint(root, 1, latest=False)
    write_checkpoint(root, 9, sealed=False, latest=False)  # unfinished: not pruning's business
    assert prune_checkpoints(root, 1, newest=4) == [iteration_dir(root, 2), iteration_dir(root, 1)]
    assert sorted(p.name for p in root.glob("iter_*")) == ["iter_0000004", "iter_0000009"]
    assert prune_checkpoints(root, None, newest=4) == []


def test_room_problem_names_both_sizes(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    assert room_problem(tmp_path, 1, "x") is None
    message = room_problem(tmp_path, free + (1 << 40), "the last checkpoint (iter_0000004)")
    assert f"not enough free space under {tmp_path}" in message
    assert "free, the last checkpoint (iter_0000004) needs" in message and "TiB" in message


def test_architecture_differences_are_named_and_parallel_sizes_are_not():
    saved = {"architecture": "dit_cross", "num_layers": 2, "hidden_size": 64, "tensor_model_parallel_size": 2}
    current = ModelConfig(architecture="dit_adaln", num_layers=1, hidden_size=64, pipeline_model_parallel_size=2)
    assert model_differences(saved, current) == [
        "model.architecture: checkpoint 'dit_cross', this run 'dit_adaln'",
        "model.num_layers: checkpoint 2, this run 1",
    ]
    same_ffn = ModelConfig(hidden_size=64, ffn_hidden_size=256)
    assert model_differences({"hidden_size": 64, "ffn_hidden_size": None}, same_ffn) == []


def imported_modules(package: Path) -> set[str]:
    names = set()
    for file in package.rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
    return names


@pytest.mark.parametrize("package", ["checkpoint", "inference"])
def test_checkpoint_and_inference_do_not_import_training(package):
    assert not {m for m in imported_modules(DFM / package) if m.startswith("dfm.training")}


def test_verify_warns_of_an_unfinished_newest_save_when_an_older_one_verifies(root, tmp_path, capsys):
    """A run stopped while saving left iter_6 without a manifest: it resumes from iter_4, so verify exits 0
    with a warning; a root whose only checkpoint is unfinished, or whose older one is damaged, exits 1."""
    write_checkpoint(root, 6, sealed=False, latest=False)
    assert verify_cli(["verify", str(root)]) == 0
    out = capsys.readouterr().out
    assert f"{iteration_dir(root, 6)}: skipped on resume: no manifest" in out and "(warning: " in out
    (iteration_dir(root, 4) / "__0_0.distcp").write_bytes(b"cut")
    (iteration_dir(root, 2) / "__0_0.distcp").write_bytes(b"cut")
    assert verify_cli(["verify", str(root)]) == 1
    only_unfinished = tmp_path / "only"
    write_checkpoint(only_unfinished, 1, sealed=False, latest=False)
    assert verify_cli(["verify", str(only_unfinished)]) == 1
