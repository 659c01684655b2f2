"""LoRA training through the real entry point (tiny Wan, base frozen): TP=2 + SP, PP=2 and
Megatron-FSDP at DP=2 give the same losses, gradient norms and weights (adapters trained, base
untouched) as one process (tests/parallel/equivalence.py: how runs are compared, tolerances)."""

from __future__ import annotations

import pytest

from tests.parallel.equivalence import (
    DP_DATA,
    FSDP,
    PP2,
    SP,
    TP2,
    assert_same_metrics,
    assert_same_weights,
    train,
)

# Fused (q/k/v: q and v only), row-parallel and MLP targets; 3 Adam steps at lr 1e-3 move B by ~3e-3.
LORA = [
    "peft.lora_rank=4",
    "peft.lora_alpha=8",
    "peft.target_modules=[to_q,to_v,to_out.0,attn2.to_k,ffn.net.0.proj]",
    "optimizer.lr=1e-3",
    *DP_DATA,
]
LAYOUTS = {"tp2_sp": [TP2, SP], "pp2": [PP2], "fsdp_dp2": FSDP}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(tmp_path_factory.mktemp("lora_ref"), "wan_tiny", 1, LORA)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_layout_trains_like_one_process(tmp_path, reference, layout):
    run = train(tmp_path, "wan_tiny", 2, [*LORA, *LAYOUTS[layout]])
    assert_same_metrics(reference.metrics, run.metrics)
    assert_same_weights(reference.weights, run.weights)
    adapters = [name for name in run.weights if ".lora." in name]
    assert adapters and any(run.weights[name].abs().max() > 0 for name in adapters if ".lora.B." in name)
