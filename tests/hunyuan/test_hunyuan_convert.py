"""HunyuanVideo 1.5 through convert_hunyuan.py's ``main``: a tiny diffusers pipeline folder is imported
with ``--verify`` (dfm vs diffusers on the mixed t2v / i2v pack), exported, and the export loads in
``HunyuanVideo15Transformer3DModel.from_pretrained`` with every tensor bit for bit the original."""

from __future__ import annotations

import json
import re

import diffusers
import torch

from dfm.convert.cli import main
from dfm.convert.hunyuan import HUNYUAN
from tests.hunyuan._tiny import tiny_diffusers_hunyuan


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def test_import_verifies_and_export_loads_in_diffusers_bit_exact(tmp_path, capsys):
    pipeline, reference = tmp_path / "HunyuanVideo-1.5-tiny", tiny_diffusers_hunyuan()
    reference.save_pretrained(pipeline / "transformer")
    (pipeline / "model_index.json").write_text(json.dumps({"_class_name": "HunyuanVideo15Pipeline"}))
    imported, export = tmp_path / "imported", tmp_path / "export"
    assert main(HUNYUAN, ["import", "--diffusers", str(pipeline), "--output", str(imported), "--verify"]) == 0
    assert float(re.search(r"max abs diff vs diffusers: (\S+)", capsys.readouterr().out).group(1)) <= 1e-5
    assert main(HUNYUAN, ["export", "--checkpoint", str(imported), "--output", str(export)]) == 0
    loaded = diffusers.HunyuanVideo15Transformer3DModel.from_pretrained(export)
    assert all(_plain(loaded.config[k]) == _plain(v) for k, v in reference.config.items() if not k.startswith("_"))
    back, original = loaded.state_dict(), reference.state_dict()
    assert sorted(back) == sorted(original)
    assert all(torch.equal(back[name], tensor) for name, tensor in original.items())
