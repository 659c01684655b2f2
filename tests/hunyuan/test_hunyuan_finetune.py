"""HunyuanVideo 1.5 through the real entry points: a tiny diffusers pipeline folder is imported
(convert_hunyuan.py's ``main`` with ``--verify``: dfm vs diffusers on the mixed t2v / i2v pack) and
exported back bit for bit; the import is fine-tuned 3 iterations at TP=2 + SP from
``checkpoint.pretrained`` (pretrain entry point) on HunyuanVideo 1.5 shards (ByT5 text, first-frame
latent, SigLIP embedding per clip; ``dataset.i2v_prob=0.5``), exported, and the export is diffusers'
model (``from_pretrained``) holding exactly the weights the ranks trained."""

from __future__ import annotations

import json
import re
from pathlib import Path

import diffusers
import torch

from dfm.convert.cli import main
from dfm.convert.hunyuan import HUNYUAN, hunyuan_rules
from dfm.convert.rules import to_diffusers
from tests.hunyuan._tiny import dfm_config_and_weights, tiny_diffusers_hunyuan, write_hunyuan_shards
from tests.parallel.equivalence import WEIGHTS_ENTRY
from tests.training.entry import read_metrics, run_entry

HUNYUAN_TINY = Path(__file__).resolve().parents[2] / "examples/megatron/recipes/hunyuan/conf/hunyuan_tiny.yaml"


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def load_export(folder: Path, reference) -> dict:
    """The exported folder through diffusers' from_pretrained; its config must be ``reference``'s."""
    loaded = diffusers.HunyuanVideo15Transformer3DModel.from_pretrained(folder)
    assert all(_plain(loaded.config[k]) == _plain(v) for k, v in reference.config.items() if not k.startswith("_"))
    return loaded.state_dict()


def test_import_verify_finetune_at_tp2_export_loads_in_diffusers(tmp_path, capsys):
    pipeline, reference = tmp_path / "HunyuanVideo-1.5-tiny", tiny_diffusers_hunyuan()
    reference.save_pretrained(pipeline / "transformer")
    (pipeline / "model_index.json").write_text(json.dumps({"_class_name": "HunyuanVideo15Pipeline"}))
    cfg, start = dfm_config_and_weights(reference)
    imported, trained, dump = tmp_path / "imported", tmp_path / "trained", tmp_path / "weights.pt"
    assert main(HUNYUAN, ["import", "--diffusers", str(pipeline), "--output", str(imported), "--verify"]) == 0
    assert float(re.search(r"max abs diff vs diffusers: (\S+)", capsys.readouterr().out).group(1)) <= 1e-5

    # Import then export, untouched: every tensor back bit for bit.
    assert main(HUNYUAN, ["export", "--checkpoint", str(imported), "--output", str(tmp_path / "same")]) == 0
    same, original = load_export(tmp_path / "same", reference), reference.state_dict()
    assert sorted(same) == sorted(original)
    assert all(torch.equal(same[name], tensor) for name, tensor in original.items())

    shards = write_hunyuan_shards(tmp_path / "shards", cfg.model)
    args = ["train.train_iters=3", "optimizer.lr=1e-4", f"logger.log_dir={tmp_path / 'log'}"]
    args += [f"dataset.path={shards}", "dataset.num_workers=0", "dataset.i2v_prob=0.5"]
    args += ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true", f"checkpoint.pretrained={imported}"]
    args += [f"checkpoint.save={trained}", "checkpoint.save_interval=3"]
    result = run_entry(
        2, args, entry=WEIGHTS_ENTRY, env={"DFM_TEST_FULL_WEIGHTS": str(dump)}, config=HUNYUAN_TINY, mock=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [m["iteration"] for m in read_metrics(tmp_path / "log")] == [1, 2, 3]
    assert main(HUNYUAN, ["export", "--checkpoint", str(trained), "--output", str(tmp_path / "export")]) == 0
    exported = load_export(tmp_path / "export", reference)

    weights = torch.load(dump)  # gathered from the TP=2 ranks, independently of the checkpoint
    expected = to_diffusers(weights, hunyuan_rules(cfg.model))
    assert sorted(exported) == sorted(expected)
    assert all(torch.equal(exported[name], tensor) for name, tensor in expected.items())
    # Fine-tuned from the imported weights (3 Adam steps of lr 1e-4 move a weight by <= ~3e-4).
    moved = max(float((weights[name] - start[name]).abs().max()) for name in start)
    assert 0 < moved < 1e-3
