"""LoRA training through the real entry point (tiny Wan, base frozen): TP=2 + SP x PP=2 (4 processes,
both dimensions in one run) and Megatron-FSDP at DP=2 give the same losses, gradient norms and
weights (adapters trained, base untouched) as one process (tests/parallel/equivalence.py: how runs
are compared, tolerances). The TP x PP run's checkpoint (adapters split over TP, blocks over stages)
goes through ``convert_wan.py export-lora`` and ``export --merge-lora``: the files hold the
one-process run's adapters and merged weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dfm.convert.cli import main
from dfm.convert.diffusers_folder import DiffusersWeights
from dfm.convert.rules import to_diffusers
from dfm.convert.wan import WAN, rules
from dfm.inference.checkpoint_loading import checkpoint_config, checkpoint_directory
from dfm.peft.export import FILE_NAME, lora_state_dict, merged_weights
from tests.parallel.equivalence import (
    DP_DATA,
    FSDP,
    PP2,
    SP,
    TP2,
    assert_same_metrics,
    assert_same_weights,
    train,
    world_size,
)
from tests.peft.test_lora_memory import assert_measured_matches_formula

# Fused (q/k/v: q and v only), row-parallel and MLP targets; 3 Adam steps at lr 1e-3 move B by ~3e-3.
LORA = [
    "peft.lora_rank=4",
    "peft.lora_alpha=8",
    "peft.target_modules=[to_q,to_v,to_out.0,attn2.to_k,ffn.net.0.proj]",
    "optimizer.lr=1e-3",
    *DP_DATA,
]
SAVE = ["checkpoint.save_interval=3"]
LAYOUTS = {"tp2_sp_pp2": [TP2, SP, PP2, *SAVE], "fsdp_dp2": FSDP}


def log_dir(tmp: Path) -> Path:
    return next(tmp.glob("*/memory_per_rank.json")).parent


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_ref")
    run = train(tmp, "wan_tiny", 1, LORA)
    assert_measured_matches_formula(log_dir(tmp))
    return run


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_layout_trains_like_one_process(tmp_path, reference, layout):
    saving = [f"checkpoint.save={tmp_path / 'ckpt'}"] if SAVE[0] in LAYOUTS[layout] else []
    run = train(tmp_path, "wan_tiny", world_size(LAYOUTS[layout]), [*LORA, *LAYOUTS[layout], *saving])
    assert_same_metrics(reference.metrics, run.metrics)
    assert_same_weights(reference.weights, run.weights)
    adapters = [name for name in run.weights if ".lora." in name]
    assert adapters and any(run.weights[name].abs().max() > 0 for name in adapters if ".lora.B." in name)
    if layout != "fsdp_dp2":  # FSDP shards whole rows: tests/parallel/test_fsdp_memory.py's measure
        assert_measured_matches_formula(log_dir(tmp_path))
    if saving:
        check_exports(tmp_path, reference.weights)


def check_exports(tmp_path, expected) -> None:
    """export-lora and export --merge-lora of the run's checkpoint hold ``expected``'s adapters, merged weights."""
    ckpt = tmp_path / "ckpt"
    cfg = checkpoint_config(checkpoint_directory(ckpt))
    assert main(WAN, ["export-lora", "--checkpoint", str(ckpt), "--output", str(tmp_path / "lora")]) == 0
    written, wanted = (
        load_file(tmp_path / "lora" / FILE_NAME),
        lora_state_dict(expected, cfg.model, cfg.peft, rules(cfg.model)),
    )
    assert sorted(written) == sorted(wanted)
    for key, tensor in wanted.items():
        torch.testing.assert_close(written[key], tensor, rtol=0, atol=1e-6)
    assert main(WAN, ["export", "--checkpoint", str(ckpt), "--output", str(tmp_path / "merged"), "--merge-lora"]) == 0
    folder = DiffusersWeights(tmp_path / "merged")
    for key, tensor in to_diffusers(
        merged_weights(expected, cfg.model, cfg.peft, rules(cfg.model)), rules(cfg.model)
    ).items():
        torch.testing.assert_close(folder.read(key), tensor, rtol=0, atol=1e-6)
