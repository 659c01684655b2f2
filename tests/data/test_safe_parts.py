"""Shard parts are data, never code: a crafted ``.pickle`` or ``.pth`` (a ``__reduce__`` payload that would
create a marker file) stops training naming shard, key and part, and nothing runs; shards written the way
DFM's preparation writes them (tensor or numpy array in ``.pickle``, tensor in ``.pth``) decode unchanged.
The loader position is JSON text; positions pickled by earlier versions resume exactly, read as data.
"""

from __future__ import annotations

import datetime
import io
import json
import os
import pickle
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from test_resume import energon_settings, pack_signature

from dfm.config.loader import apply_overrides
from dfm.config.recipes import get_recipe
from dfm.data.energon.cooker import BadSampleError, cook_diffusion_sample
from dfm.data.energon.data_module import PICKLED_STATE_FORMAT, build_train_loader
from dfm.data.energon.part_decoding import decode_parts
from dfm.data.prepare.shards import encode_sample_parts
from dfm.parallel.layout import ParallelLayout
from dfm.safe_unpickle import UnsafePickleError
from dfm.training.data import energon_settings as training_energon_settings


class Payload:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def overwrite_part(shard: Path, part: str, payload: bytes) -> str:
    """Replace the first sample's ``part`` in the tar in place (same size, so energon's index stays valid); -> key."""
    with tarfile.open(shard) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(f".{part}"))
    assert len(payload) <= member.size, "payload larger than the part it replaces"
    with open(shard, "r+b") as handle:
        handle.seek(member.offset_data)
        handle.write(payload + b" " * (member.size - len(payload)))  # pickle ignores bytes after its end
    return member.name.rsplit("/", 1)[-1].removesuffix(f".{part}")


@pytest.mark.parametrize("part", ["pickle", "pth"])
def test_a_crafted_part_stops_training_naming_shard_and_key_and_runs_nothing(synthetic_dataset, tmp_path, part):
    dataset = tmp_path / "dataset"
    shutil.copytree(synthetic_dataset, dataset)
    shard = sorted(dataset.glob("*.tar"))[0]
    marker = tmp_path / "code-ran"
    key = overwrite_part(shard, part, pickle.dumps(Payload(marker), protocol=2))
    loader = build_train_loader(energon_settings(dataset, num_workers=0), dp_rank=0, dp_size=1)
    with pytest.raises(Exception, match="refused") as error:
        for _ in range(20):  # every sample is read within the first packs
            next(loader)
    message = str(error.value)
    assert shard.name in message and f"key {key}" in message and f"part '.{part}'" in message, message
    assert not marker.exists()


POOLED = torch.randn(6)  # FLUX's pooled text vector, a second '.pth' part


def dfm_style_parts(text) -> dict:
    """A sample as DFM's preparation writes it, with ``text`` as its ``.pickle`` content."""
    parts = encode_sample_parts("s0", torch.randn(4, 1, 4, 4), torch.zeros(3, 8), {"caption": "c"}, POOLED)
    parts["pickle"] = pickle.dumps(text)
    return {**parts, "__restore_key__": (), "__sources__": None}


@pytest.mark.parametrize("kind", ["numpy", "tensor", "batched tensor"])
def test_dfm_shard_parts_decode_unchanged(kind):
    text = torch.randn(5, 8)
    stored = {"numpy": text.numpy(), "tensor": text, "batched tensor": text[None]}[kind]
    crude = dfm_style_parts(stored)
    cooked = cook_diffusion_sample(decode_parts(crude))
    assert torch.equal(cooked.text_embeddings, text) and torch.equal(cooked.pooled_text, POOLED)
    assert torch.equal(cooked.latent, torch.load(io.BytesIO(crude["pth"]), weights_only=True))


def test_allow_pickle_opts_into_full_pickle():
    crude = dfm_style_parts(np.zeros(2))
    crude["pickle"] = pickle.dumps(datetime.date(2026, 1, 1))  # harmless, but not an array
    with pytest.raises(BadSampleError, match="refused to load datetime.date"):
        decode_parts(crude)
    assert decode_parts(crude, allow_pickle=True)["pickle"] == datetime.date(2026, 1, 1)


def test_loader_position_is_json_and_pickled_positions_still_resume_as_data(synthetic_dataset, tmp_path):
    settings = energon_settings(synthetic_dataset, num_workers=0)
    reference = build_train_loader(settings, dp_rank=0, dp_size=1)
    for _ in range(3):
        next(reference)
    state = reference.state_dict()
    pickled = {
        **state,
        "format": PICKLED_STATE_FORMAT,
        "energon_state": pickle.dumps(reference.loader.save_state_rank()),
    }
    json.loads(state["energon_state"])  # text, no pickle
    expected = [pack_signature(next(reference)) for _ in range(3)]
    for saved in (state, pickled):
        resumed = build_train_loader(settings, dp_rank=0, dp_size=1)
        resumed.load_state_dict(saved)
        assert [pack_signature(next(resumed)) for _ in range(3)] == expected
    marker = tmp_path / "code-ran"
    crafted = {**pickled, "energon_state": pickle.dumps(Payload(marker))}
    with pytest.raises(UnsafePickleError, match=r"the saved loader state \(v1\): refused to load posix.system"):
        build_train_loader(settings, dp_rank=0, dp_size=1).load_state_dict(crafted)
    assert not marker.exists()


def test_allow_pickle_is_a_training_config_key_that_reaches_the_loader():
    cfg = get_recipe("dit_tiny")
    apply_overrides(cfg, ["dataset.allow_pickle=true", "dataset.path=/data/set"])
    layout = ParallelLayout.from_config(cfg.model, 1)
    assert training_energon_settings(cfg, layout).allow_pickle is True
    assert get_recipe("dit_tiny").dataset.allow_pickle is False  # off unless asked for
