"""What the converters do to the folders they read and write (convert_wan.py's ``main``, a tiny Wan):

* export and import write a fresh folder and replace the target only when complete: a non-empty
  target needs ``--overwrite``, an old sharded export is replaced whole (no stale index or shards),
  a folder that is not the converter's own (a training run, foreign files) is never replaced;
* a folder of another diffusers class, or a truncated safetensors file, is refused naming the file;
* both read tensor by tensor: the source tensors alive at once stay far below the model's bytes;
* an export gives the dtype the import read back (bf16 in, bf16 out), or ``--dtype``'s.
"""

from __future__ import annotations

import contextlib
import io
import json
import weakref

import pytest
import torch
from safetensors.torch import load_file

import dfm.convert.diffusers_folder as diffusers_folder
from dfm.convert.cli import main
from dfm.convert.diffusers_folder import WEIGHTS, write_diffusers_folder
from dfm.convert.safetensors_stream import StreamingWriter
from dfm.convert.wan import WAN
from tests.wan._tiny import tiny_diffusers_wan

TEXT = ["model.max_text_len=16", "dataset.mock_text_len_range=[4,12]"]


def run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(WAN, argv)
    return code, out.getvalue()


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(bf16 diffusers model folder, its tensors, its import)."""
    tmp = tmp_path_factory.mktemp("folders")
    tiny_diffusers_wan().to(torch.bfloat16).save_pretrained(tmp / "model")
    code, out = run(["import", "--diffusers", str(tmp / "model"), "--output", str(tmp / "imported"), *TEXT])
    assert code == 0, out
    return tmp / "model", load_file(tmp / "model" / WEIGHTS), tmp / "imported"


def test_export_gives_the_imported_dtype_or_the_requested_one(source, tmp_path):
    _, state, imported = source
    assert run(["export", "--checkpoint", str(imported), "--output", str(tmp_path / "same")])[0] == 0
    back = load_file(tmp_path / "same" / WEIGHTS)
    assert sorted(back) == sorted(state)
    assert all(back[n].dtype == torch.bfloat16 and torch.equal(back[n], t) for n, t in state.items())
    assert run(["export", "--checkpoint", str(imported), "--output", str(tmp_path / "f32"), "--dtype", "fp32"])[0] == 0
    wide = load_file(tmp_path / "f32" / WEIGHTS)
    assert all(wide[n].dtype == torch.float32 and torch.equal(wide[n], t.float()) for n, t in state.items())


def test_export_replaces_an_old_sharded_export_whole_and_only_with_overwrite(source, tmp_path):
    _, state, imported = source
    target = tmp_path / "export"
    old = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
    write_diffusers_folder(target, {"_class_name": "WanTransformer3DModel"}, old, max_shard_bytes=4096)
    before = sorted(p.name for p in target.iterdir())
    assert len(before) > 3  # config, index and several shards

    code, out = run(["export", "--checkpoint", str(imported), "--output", str(target)])
    assert code == 2 and f"{target} is not empty: pass --overwrite" in out
    assert sorted(p.name for p in target.iterdir()) == before

    assert run(["export", "--checkpoint", str(imported), "--output", str(target), "--overwrite"])[0] == 0
    assert sorted(p.name for p in target.iterdir()) == ["config.json", WEIGHTS]
    back = load_file(target / WEIGHTS)
    assert all(torch.equal(back[name], tensor) for name, tensor in state.items())
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left

    (target / "notes.txt").write_text("mine")
    code, out = run(["export", "--checkpoint", str(imported), "--output", str(target), "--overwrite"])
    assert code == 2 and "holds notes.txt, which an export does not write" in out
    assert (target / "notes.txt").read_text() == "mine"


def test_import_refuses_a_training_root_and_replaces_an_import_only_with_overwrite(source, tmp_path):
    from megatron.core import dist_checkpointing

    from dfm.convert.weights import single_process_world

    model, _, imported = source
    training = tmp_path / "run"
    (training / "iter_0000100").mkdir(parents=True)
    with single_process_world(0):
        dist_checkpointing.save({"iteration": 100, "config": {}}, str(training / "iter_0000100"))
    (training / "latest").write_text("100\n")
    for extra in ([], ["--overwrite"]):
        code, out = run(["import", "--diffusers", str(model), "--output", str(training), *TEXT, *extra])
        assert code == 2 and "holds training checkpoint iter_0000100" in out, out
    assert (training / "latest").read_text() == "100\n"
    assert sorted(p.name for p in training.iterdir()) == ["iter_0000100", "latest"]

    again = tmp_path / "again"
    assert run(["import", "--diffusers", str(model), "--output", str(again), *TEXT])[0] == 0
    code, out = run(["import", "--diffusers", str(model), "--output", str(again), *TEXT])
    assert code == 2 and "pass --overwrite" in out
    assert run(["import", "--diffusers", str(model), "--output", str(again), *TEXT, "--overwrite"])[0] == 0
    assert sorted(p.name for p in again.iterdir()) == ["iter_0000000", "latest"]


def test_other_class_and_truncated_file_are_refused_naming_the_file(source, tmp_path):
    model, _, _ = source
    flux = tmp_path / "flux"
    flux.mkdir()
    (flux / "config.json").write_text(json.dumps({"_class_name": "FluxTransformer2DModel", "patch_size": 1}))
    code, out = run(["import", "--diffusers", str(flux), "--output", str(tmp_path / "a")])
    assert code == 2 and f"{flux / 'config.json'}: _class_name is 'FluxTransformer2DModel'" in out
    assert "WanTransformer3DModel" in out

    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "config.json").write_bytes((model / "config.json").read_bytes())
    data = (model / WEIGHTS).read_bytes()
    (cut / WEIGHTS).write_bytes(data[: len(data) // 2])
    code, out = run(["import", "--diffusers", str(cut), "--output", str(tmp_path / "b")])
    assert code == 2 and f"{cut / WEIGHTS}: not a readable safetensors file" in out
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


class LiveBytes:
    """Bytes of the tensors passed to ``track`` that are still alive, and the most at any time."""

    def __init__(self):
        self.alive = self.peak = 0

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        size = tensor.numel() * tensor.element_size()
        self.alive += size
        self.peak = max(self.peak, self.alive)
        weakref.finalize(tensor, self.release, size)
        return tensor

    def release(self, size: int) -> None:
        self.alive -= size


def test_import_and_export_hold_one_rule_of_tensors_at_a_time(source, tmp_path, monkeypatch):
    """Counting: the source tensors an import reads, and the tensors an export writes, alive at once."""
    model, state, imported = source
    total = sum(t.numel() * t.element_size() for t in state.values())
    largest_rule = 3 * max(t.numel() * t.element_size() for t in state.values())  # q, k, v of one projection
    read, written = LiveBytes(), LiveBytes()
    real_read, real_write = diffusers_folder.read_tensor, StreamingWriter.write
    monkeypatch.setattr(diffusers_folder, "read_tensor", lambda file, name: read.track(real_read(file, name)))
    monkeypatch.setattr(StreamingWriter, "write", lambda self, name, t: real_write(self, name, written.track(t)))
    assert run(["import", "--diffusers", str(model), "--output", str(tmp_path / "c"), *TEXT])[0] == 0
    assert run(["export", "--checkpoint", str(imported), "--output", str(tmp_path / "e")])[0] == 0
    for counted in (read, written):
        assert 0 < counted.peak <= largest_rule and counted.peak < total / 4, (counted.peak, largest_rule, total)
