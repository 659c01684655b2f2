"""Checkpoints are data, never code: a crafted ``.metadata`` or per-rank object (``__reduce__`` payload that
would create a marker file) is refused naming the file on every load path, and the marker never appears.

One process, the tiny model, built in-process: a training checkpoint saved through ``save_checkpoint``,
then crafted copies, each with a manifest rewritten to match (a manifest proves no authenticity).
Refusals inside torch distributed checkpoint arrive wrapped in its CheckpointException (a BaseException).
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from dfm.checkpoint.__main__ import main as checkpoint_cli
from dfm.checkpoint.load import load_checkpoint
from dfm.checkpoint.manifest import checkpoint_files, describe_files, write_manifest
from dfm.checkpoint.save import save_checkpoint
from dfm.checkpoint.state import TrainingState
from dfm.checkpoint.weights_only import load_pretrained
from dfm.config.loader import config_to_dict
from dfm.config.recipes import get_recipe
from dfm.convert.pretrained import read_full_weights
from dfm.inference.checkpoint_loading import checkpoint_config, load_model, single_process_config
from dfm.parallel.layout import ParallelLayout
from dfm.platform.compat.checkpointing import ensure_adam_state
from dfm.platform.distributed import destroy_distributed, initialize_distributed
from dfm.training.data import build_train_loader
from dfm.training.pretrain import finalize_defaults
from dfm.training.setup import build_model, build_optimizer


class Payload:
    """Unpickled with full pickle, creates ``path``: the proof that code ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


class Run:
    """Model, optimizer, schedule and loader of the tiny recipe in this process (TP = PP = DP = 1)."""

    def __init__(self) -> None:
        self.cfg = get_recipe("dit_tiny")
        layout = ParallelLayout.from_config(self.cfg.model, 1)
        finalize_defaults(self.cfg, layout)
        self.model, tconfig = build_model(self.cfg, layout, torch.device("cpu"))
        self.optimizer, self.scheduler = build_optimizer(self.cfg, self.model, tconfig)
        self.loader = build_train_loader(self.cfg, layout, mock=True)

    def save(self, root: Path) -> Path:
        ensure_adam_state(self.optimizer)  # as after a step: the checkpoint holds Adam's moments
        return save_checkpoint(str(root), 1, self.state(), config_to_dict(self.cfg))

    def resume(self, root: Path) -> int:
        return load_checkpoint(str(root), self.state())

    def state(self) -> TrainingState:
        return TrainingState(self.model, self.optimizer, self.scheduler, self.loader)


@pytest.fixture(scope="module")
def run():
    initialize_distributed(seed=1234)
    try:
        yield Run()
    finally:
        destroy_distributed()


@pytest.fixture(scope="module")
def saved(run, tmp_path_factory) -> Path:
    """A complete training checkpoint root (iter_0000001, latest=1)."""
    root = tmp_path_factory.mktemp("saved") / "ckpt"
    run.save(root)
    return root


def sealed(directory: Path) -> None:
    """A manifest matching the directory as it now is, as whoever crafted it would write."""
    (directory / "manifest.json").unlink()
    write_manifest(directory, describe_files(directory, checkpoint_files(directory)))


@pytest.fixture
def marker(tmp_path) -> Path:
    path = tmp_path / "code-ran"
    yield path
    assert not path.exists(), "a crafted pickle ran code"


@pytest.fixture
def crafted_metadata(saved, tmp_path, marker) -> tuple[Path, Path]:
    """(root, its .metadata) with the .metadata replaced by a payload."""
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    metadata = root / "iter_0000001" / ".metadata"
    metadata.write_bytes(pickle.dumps(Payload(marker)))
    sealed(metadata.parent)
    return root, metadata


@pytest.fixture
def crafted_rank_object(run, tmp_path, marker, monkeypatch) -> Path:
    """A checkpoint root whose per-rank RNG object holds a payload (written through the real save)."""
    root = tmp_path / "rank_object_ckpt"
    monkeypatch.setattr("dfm.checkpoint.state.rng_state", lambda: {"python": Payload(marker)})
    run.save(root)
    return root


def test_resume_refuses_crafted_metadata(run, crafted_metadata):
    root, metadata = crafted_metadata
    with pytest.raises(BaseException, match="refused") as error:
        run.resume(root)
    assert str(metadata) in str(error.value)


def test_resume_refuses_a_crafted_rank_object(run, crafted_rank_object):
    with pytest.raises(BaseException, match="refused") as error:
        run.resume(crafted_rank_object)
    message = str(error.value)
    assert str(crafted_rank_object / "iter_0000001") in message and "rng_state" in message, message


def test_pretrained_refuses_crafted_metadata(run, crafted_metadata):
    root, metadata = crafted_metadata
    with pytest.raises(BaseException, match="refused") as error:
        load_pretrained(root, run.model)
    assert str(metadata) in str(error.value)


def test_inference_and_export_refuse_crafted_metadata(saved, crafted_metadata):
    root, metadata = crafted_metadata
    directory = metadata.parent
    cfg = single_process_config(checkpoint_config(saved / "iter_0000001"))
    with pytest.raises(BaseException, match="refused") as error:
        load_model(cfg, directory, torch.device("cpu"))  # what inference_dit_model.py --checkpoint_path calls
    assert str(metadata) in str(error.value)
    with pytest.raises(BaseException, match="refused") as error:
        read_full_weights(root)  # what convert_*.py export calls
    assert str(metadata) in str(error.value)


def test_verify_reads_every_pickle_as_data(saved, crafted_metadata, crafted_rank_object, capsys):
    assert checkpoint_cli(["verify", str(saved)]) == 0
    root, metadata = crafted_metadata
    assert checkpoint_cli(["verify", str(root)]) == 1
    assert f"DAMAGED: {metadata}: refused to load posix.system" in capsys.readouterr().out
    assert checkpoint_cli(["verify", str(crafted_rank_object)]) == 1
    out = capsys.readouterr().out
    assert str(crafted_rank_object / "iter_0000001" / "__0_") in out and "rng_state" in out and "refused" in out


def test_numpys_rng_state_loads_without_megatrons_safe_globals():
    """numpy >= 1.25 pickles a dtype by its class (numpy.dtypes.UInt32DType); megatron registers such
    classes as torch safe globals when imported, ``verify`` must not depend on that."""
    import io

    import numpy as np

    from dfm.safe_unpickle import load_rank_object

    registered = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        data = io.BytesIO()
        torch.save({"numpy": np.random.get_state()}, data)
        data.seek(0)
        state = load_rank_object(data, "rng")["numpy"]
        assert state[0] == "MT19937" and state[1].dtype == np.uint32
    finally:
        torch.serialization.add_safe_globals(registered)


@pytest.fixture
def crafted_common(saved, tmp_path, marker) -> tuple[Path, Path]:
    """(root, its common.pt) with common.pt holding a payload beside the real common state."""
    root = tmp_path / "common_ckpt"
    shutil.copytree(saved, root)
    common = root / "iter_0000001" / "common.pt"
    state = torch.load(common, weights_only=True)
    torch.save({**state, "payload": Payload(marker)}, common)
    sealed(common.parent)
    return root, common


def test_common_state_is_weights_only_whatever_the_environment_says(run, saved, crafted_common, monkeypatch, capsys):
    """``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` (set by users for other tools) makes megatron's plain
    ``torch.load`` of common.pt full pickle; dfm loads it weights-only anyway, naming the file."""
    root, common = crafted_common
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(BaseException, match="refused") as error:
        run.resume(root)
    assert str(common) in str(error.value)
    with pytest.raises(BaseException, match="refused") as error:
        load_pretrained(root, run.model)
    assert str(common) in str(error.value)
    assert checkpoint_cli(["verify", str(saved)]) == 0
    assert checkpoint_cli(["verify", str(root)]) == 1
    assert f"DAMAGED: {common}: refused to load" in capsys.readouterr().out


def te_like_extra_state(monkeypatch, saved_state) -> list:
    """megatron's linears get Transformer Engine's extra-state protocol: ``get_extra_state`` returns a uint8
    tensor of pickle bytes (``saved_state``'s), ``set_extra_state`` ``pickle.loads`` it; -> what each set got."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    received = []

    def get_extra_state(self):
        return torch.frombuffer(bytearray(pickle.dumps(saved_state)), dtype=torch.uint8)

    def set_extra_state(self, state):
        received.append(state)
        if isinstance(state, torch.Tensor) and state.numel():
            pickle.loads(state.numpy().tobytes())  # what TE does

    for cls in (ColumnParallelLinear, RowParallelLinear):
        monkeypatch.setattr(cls, "get_extra_state", get_extra_state)
        monkeypatch.setattr(cls, "set_extra_state", set_extra_state)
    return received


def test_extra_state_holding_a_pickle_is_refused_naming_file_and_key(run, tmp_path, marker, monkeypatch, capsys):
    """TE's ``set_extra_state`` unpickles the checkpoint's bytes: dfm reads them through the array allow-list
    first (a payload is refused, naming the file and the key) and hands the module an empty state."""
    te_like_extra_state(monkeypatch, Payload(marker))
    root = tmp_path / "extra_state_ckpt"
    run.save(root)
    with pytest.raises(BaseException, match="refused") as error:
        run.resume(root)
    message = str(error.value)
    assert str(root / "iter_0000001") in message and "._extra_state" in message, message
    assert checkpoint_cli(["verify", str(root)]) == 1
    assert "._extra_state" in capsys.readouterr().out


def test_extra_state_holding_data_is_dropped_and_rebuilt(run, tmp_path, monkeypatch):
    received = te_like_extra_state(monkeypatch, {"scale_fwd": torch.ones(3), "amax_history_fwd": torch.zeros(2, 3)})
    root = tmp_path / "extra_state_ckpt"
    run.save(root)
    load_pretrained(root, run.model)  # the model's part of a resume (extra state included), weights only
    assert received and all(isinstance(s, torch.Tensor) and s.numel() == 0 for s in received)
