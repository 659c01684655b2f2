"""FLUX.1 conversion through the real entry points: a tiny diffusers FLUX is imported
(convert_flux.py's ``main``, with ``--verify``), fine-tuned 3 iterations at TP=2 from
``checkpoint.pretrained`` on mock data, exported, and loaded by diffusers."""

from __future__ import annotations

import re
from pathlib import Path

import diffusers
import torch

from dfm.convert.cli import main
from dfm.convert.flux import FLUX, flux_rules
from dfm.convert.rules import to_diffusers
from tests.flux._tiny import dfm_config_and_weights, tiny_diffusers_flux
from tests.parallel.equivalence import WEIGHTS_ENTRY
from tests.training.entry import run_entry

FLUX_TINY = (
    Path(__file__).resolve().parents[2] / "examples" / "megatron" / "recipes" / "flux" / "conf" / "flux_tiny.yaml"
)
# The model of flux_tiny.yaml, as diffusers writes it.
TINY_AS_FLUX_TINY_YAML = dict(
    num_attention_heads=4, attention_head_dim=16, joint_attention_dim=32, pooled_projection_dim=16
)


def test_import_finetune_at_tp2_export_loads_in_diffusers(tmp_path, capsys):
    source, reference = tmp_path / "diffusers", tiny_diffusers_flux(**TINY_AS_FLUX_TINY_YAML)
    reference.save_pretrained(source)
    original = reference.state_dict()
    cfg, start = dfm_config_and_weights(reference)
    imported = tmp_path / "imported"
    assert main(FLUX, ["import", "--diffusers", str(source), "--output", str(imported), "--verify"]) == 0
    assert float(re.search(r"max abs diff vs diffusers: (\S+)", capsys.readouterr().out).group(1)) <= 1e-5

    # Import then export, untouched: every tensor back bit for bit.
    assert main(FLUX, ["export", "--checkpoint", str(imported), "--output", str(tmp_path / "same")]) == 0
    same = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path / "same").state_dict()
    assert sorted(same) == sorted(original)
    assert all(torch.equal(same[name], tensor) for name, tensor in original.items())

    trained, dump = tmp_path / "trained", tmp_path / "weights.pt"
    args = ["train.train_iters=3", "optimizer.lr=1e-4", f"logger.log_dir={tmp_path / 'log'}"]
    args += ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true", f"checkpoint.pretrained={imported}"]
    args += [f"checkpoint.save={trained}", "checkpoint.save_interval=3"]
    result = run_entry(2, args, entry=WEIGHTS_ENTRY, env={"DFM_TEST_FULL_WEIGHTS": str(dump)}, config=FLUX_TINY)
    assert result.returncode == 0, result.stderr[-3000:]
    assert main(FLUX, ["export", "--checkpoint", str(trained), "--output", str(tmp_path / "export")]) == 0
    exported = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path / "export").state_dict()

    weights = torch.load(dump)  # gathered from the TP=2 ranks, independently of the checkpoint
    expected = to_diffusers(weights, flux_rules(cfg.model))
    assert sorted(exported) == sorted(expected)
    assert all(torch.equal(exported[name], tensor) for name, tensor in expected.items())
    # Fine-tuned from the imported weights (3 Adam steps of lr 1e-4 each move a weight by <= ~1e-4);
    # a shard loaded into the wrong place would differ by the weights' own size (~0.1).
    moved = max(float((weights[name] - start[name]).abs().max()) for name in start)
    assert 0 < moved < 1e-3
