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


DMD2_RECIPE = "examples/megatron/recipes/dit/conf/wan21_t2v_14b_dmd2.yaml"


def test_wan14b_dmd2_recipe_fits_16_gpus_of_80gb_and_not_8():
    """Three 14B networks (two trained, the teacher frozen): the recipe's TP=8 x DP=2 fits 16 x 80 GB; on 8 x
    80 GB neither its TP=8 (DP=1: the save holds both players' whole optimizer shards) nor plain data
    parallelism (every rank holds everything) does."""
    from benchmarks.memory import config_plan_lines

    lines = config_plan_lines(DMD2_RECIPE, [], world_size=16, device_gib=74.5)  # 80 GB
    assert "(TP 8, PP 1, CP 1, DP 2)" in lines[0] and "14,288,491,584 parameters" in lines[0], lines
    assert "teacher weights 3.3 GiB (frozen, bf16)" in lines[1], lines
    assert lines[-1].strip().endswith("fits 74.5 GiB per device (keeping 10% free)"), lines
    unsharded = [
        "model.tensor_model_parallel_size=1",
        "model.sequence_parallel=false",
        "ddp.use_distributed_optimizer=false",
    ]
    for overrides in ([], unsharded):
        lines = config_plan_lines(DMD2_RECIPE, overrides, world_size=8, device_gib=74.5)
        assert "DOES NOT FIT 74.5 GiB" in lines[-1], (overrides, lines)


@pytest.mark.parametrize("precision, teacher_bytes", [("bf16", 2), ("fp32", 4)])
def test_distillation_plan_counts_two_trained_networks_and_a_frozen_teacher(precision, teacher_bytes):
    """bf16: 2 + 4 + 12 bytes per parameter a player (fp32 gradients, Adam with fp32 main weights), the
    optimizer state halved over DP=2; fp32: 4 + 4 + 8. The teacher holds its weights alone."""
    from dfm.config.container import ConfigContainer
    from dfm.parallel.layout import ParallelLayout
    from dfm.training.distill_memory_plan import distill_plan
    from dfm.training.memory_plan import IO_BUFFER, layer_activation_bytes, tokens_per_rank

    cfg = ConfigContainer()
    cfg.distill.enabled, cfg.mixed_precision.precision = True, precision
    cfg.ddp.use_distributed_optimizer, cfg.train.global_batch_size = True, 2
    layout = ParallelLayout.from_config(cfg.model, 2)
    share = 10**9
    plan = distill_plan(cfg, layout, share)
    weight, grad, optimizer = (2, 4, 12) if precision == "bf16" else (4, 4, 8)
    assert plan.teacher == teacher_bytes * share
    state = plan.combined.state
    assert (state.params, state.grads, state.optimizer) == (3 * weight * share, 2 * grad * share, optimizer * share)
    own_shards = 2 * (weight + optimizer) * share // 2  # each player's weights + main weights + moments, 1/DP
    assert plan.combined.save == plan.combined.load == state.total + own_shards + IO_BUFFER
    # No recompute: the student step's backward has no recompute working set; its no-grad teacher and critic
    # calls hold one block's activations beside the student's saved ones.
    one_block = max(layer_activation_bytes(cfg.model, *tokens_per_rank(cfg, layout)))
    assert plan.combined.activations.saved == plan.player.activations.saved
    assert plan.player.activations.working == 0 and plan.combined.activations.working == one_block


@pytest.mark.parametrize("fsdp", [False, True])
def test_an_ema_adds_its_fp32_copy_to_every_phase_after_the_build(fsdp):
    """optimizer.ema_decay: 4 bytes a held parameter (the rank's whole share, or its rows under Megatron-FSDP's
    full sharding) in the training step, and that plus the rank's share of the saved EMA in save and load; a
    distillation counts the student's once (the critic keeps none)."""
    from dfm.config.container import ConfigContainer
    from dfm.parallel.layout import ParallelLayout
    from dfm.training.distill_memory_plan import distill_plan
    from dfm.training.memory_plan import config_plan

    cfg = ConfigContainer()
    cfg.train.global_batch_size = 2
    if fsdp:
        cfg.ddp.use_megatron_fsdp, cfg.ddp.data_parallel_sharding_strategy = True, "optim_grads_params"
    else:
        cfg.ddp.use_distributed_optimizer = True
    layout = ParallelLayout.from_config(cfg.model, 2)
    share = 10**9
    without = config_plan(cfg, layout, share)
    cfg.optimizer.ema_decay = 0.999
    with_ema = config_plan(cfg, layout, share)
    held = 4 * share // 2 if fsdp else 4 * share
    saved_share = held if fsdp else held // 2
    assert with_ema.ema == held and without.ema == 0
    assert with_ema.train - without.train == held
    assert with_ema.save - without.save == with_ema.load - without.load == held + saved_share
    assert with_ema.build == without.build
    cfg.distill.enabled = True
    distilled = distill_plan(cfg, layout, share)
    cfg.optimizer.ema_decay = None
    assert distilled.combined.train - distill_plan(cfg, layout, share).combined.train == held
