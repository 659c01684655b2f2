"""The memory plan's activation formula (dfm/training/memory_plan.py) against a measurement: the bytes
a bf16 forward saves for backward, counted with saved-tensor hooks (unique storages, parameters
excluded) on CPU, for every family at two sizes, within 15%; with full recompute too."""

from __future__ import annotations

import pytest
import torch

from benchmarks import activations
from benchmarks.activations import measure
from dfm.config.container import ModelConfig
from dfm.training.memory_plan import activation_bytes

# Beyond each family's defaults: the settings the coefficients were counted with.
FAMILIES = {
    "dit_adaln": dict(pos_embedding="sincos3d"),
    "dit_cross": dict(qk_layernorm=True),
    "stdit": {},
    "moviegen": dict(qk_layernorm=True),
    "wan": dict(qk_layernorm=True),
    "flux": dict(qk_layernorm=True),
}
# (hidden, layers, text tokens per sample, video latent [T, H, W], FFN multiple): neither is a size the
# coefficients were counted at.
SIZES = {"small": (48, 2, 12, (2, 8, 8), 4), "larger": (160, 3, 20, (3, 8, 12), 3)}


def model_config(family: str, hidden: int, layers: int, text_len: int, ffn: int, **extra) -> ModelConfig:
    return activations.model_config(family, hidden, layers, text_len, ffn, heads=4, **FAMILIES[family], **extra)


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_activation_formula_matches_saved_tensors(family, size):
    hidden, layers, text_len, video, ffn = SIZES[size]
    cfg = model_config(family, hidden, layers, text_len, ffn)
    measured, tokens, text_tokens = measure(cfg, video)
    predicted = activation_bytes(cfg, tokens, text_tokens).saved
    assert abs(predicted / measured - 1) < 0.15, f"{family} {size}: formula {predicted:.0f}, measured {measured}"


@pytest.mark.parametrize("family", ["dit_cross", "moviegen"])
def test_recompute_activation_drops_the_mlp_activation_output(family):
    hidden, layers, text_len, video, ffn = SIZES["larger"]
    cfg = model_config(family, hidden, layers, text_len, ffn, recompute_activation=True)
    measured, tokens, text_tokens = measure(cfg, video)
    predicted = activation_bytes(cfg, tokens, text_tokens).saved
    assert abs(predicted / measured - 1) < 0.15, f"{family}: formula {predicted:.0f}, measured {measured}"


@pytest.mark.parametrize("size", list(SIZES))
def test_recompute_keeps_each_layer_input(size):
    hidden, layers, text_len, video, ffn = SIZES[size]
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    cfg = model_config("dit_cross", hidden, layers, text_len, ffn, **recompute)
    measured, tokens, text_tokens = measure(cfg, video)
    predicted = activation_bytes(cfg, tokens, text_tokens).saved
    assert abs(predicted / measured - 1) < 0.15, f"{size}: formula {predicted:.0f}, measured {measured}"


def test_28b_64k_recipe_fits_80gb():
    from benchmarks.memory import config_plan_lines

    recipe = "examples/megatron/recipes/dit/conf/dit_28b_64k.yaml"
    lines = config_plan_lines(recipe, [], world_size=64, device_gib=74.5)  # 80 GB
    assert "(TP 1, PP 1, CP 2, DP 32)" in lines[0] and "27,726,500,416 parameters" in lines[0], lines
    assert lines[-1].strip().endswith("fits 74.5 GiB per device (keeping 10% free)"), lines


def test_start_up_log_warns_before_the_first_step_when_the_plan_does_not_fit(monkeypatch, caplog):
    from dfm.config.container import ConfigContainer
    from dfm.parallel.layout import ParallelLayout
    from dfm.training import memory_plan

    cfg = ConfigContainer()
    cfg.train.global_batch_size = 1
    layout = ParallelLayout.from_config(cfg.model, 1)
    monkeypatch.setattr(memory_plan, "device_memory", lambda device: 2**30)  # a 1 GiB "GPU"
    with caplog.at_level("INFO", logger="dfm.train"):
        memory_plan.log_plan(cfg, layout, share=100_000_000, device=torch.device("cpu"))
    assert "memory plan per rank" in caplog.text and "DOES NOT FIT 1.0 GiB" in caplog.text
    assert any(r.levelname == "WARNING" and "does not fit this device" in r.message for r in caplog.records)
