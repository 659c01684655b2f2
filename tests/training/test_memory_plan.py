"""The memory plan's activation formula (dfm/training/memory_plan.py) against a measurement: the bytes
a bf16 forward saves for backward, counted with saved-tensor hooks (unique storages, parameters
excluded) on CPU, for every family at two sizes, within 15%; with full recompute too."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.module import Float16Module

from dfm.config.container import ModelConfig
from dfm.convert.pretrained import single_process_world
from dfm.data.mock import MockDataSettings, MockPackedLoader, MockPacking
from dfm.models.build import build_model_chunk
from dfm.training.memory_plan import activation_bytes

TEXT_DIM = 24
FAMILIES = {
    "dit_adaln": dict(architecture="dit_adaln", num_classes=10, pos_embedding="sincos3d"),
    "dit_cross": dict(architecture="dit_cross", qk_layernorm=True),
    "stdit": dict(architecture="stdit"),
    "moviegen": dict(architecture="moviegen", qk_layernorm=True),
    "wan": dict(architecture="wan", qk_layernorm=True, pipeline="flow"),
    "flux": dict(architecture="flux", pooled_text_dim=12, guidance_embeds=True, pipeline="flow", qk_layernorm=True),
}
# (hidden, layers, text tokens per sample, video latent [T, H, W], FFN multiple): neither is a size the
# coefficients were counted at.
SIZES = {"small": (48, 2, 12, (2, 8, 8), 4), "larger": (160, 3, 20, (3, 8, 12), 3)}


def model_config(family: str, hidden: int, layers: int, text_len: int, ffn: int, **extra) -> ModelConfig:
    fields = dict(FAMILIES[family], **extra)
    if family == "flux":
        head = hidden // 4
        axis = (3 * head // 8) // 2 * 2
        fields.update(num_single_layers=1, rope_axes_dim=[head - 2 * axis, axis, axis])
    return ModelConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=4,
        ffn_hidden_size=ffn * hidden,
        in_channels=4,
        text_embed_dim=TEXT_DIM,
        max_text_len=text_len,
        max_latent_thw=[8, 32, 32],
        attention_backend="sdpa",
        **fields,
    )


def saved_bytes(model: torch.nn.Module, forward) -> int:
    """Unique storage bytes autograd saves during ``forward()`` (parameters are not activations)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params and storage.nbytes():
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward()
    return sum(seen.values())


def measure(cfg: ModelConfig, video: tuple[int, int, int], samples: int = 2) -> tuple[int, int, int]:
    """(saved bytes, video tokens, text tokens) of one bf16 forward on a two-sample pack."""
    settings = MockDataSettings(
        seed=0,
        video_sizes=[video],
        image_fraction=0.0,
        text_len_range=(cfg.max_text_len, cfg.max_text_len),
        in_channels=cfg.in_channels,
        text_embed_dim=TEXT_DIM,
        pooled_text_dim=cfg.pooled_text_dim,
    )
    batch = next(MockPackedLoader(settings, 0, 1, MockPacking(10**6, samples_per_pack=samples)))
    t = torch.rand(samples, generator=torch.Generator().manual_seed(0))
    extra = {"flux": torch.full((samples,), 3.5), "dit_adaln": torch.zeros(samples, dtype=torch.long)}
    with single_process_world(0):
        inner, tconfig = build_model_chunk(cfg, "bf16", 0)
        model = Float16Module(tconfig, inner).train()  # casts inputs to bf16 as training does
        measured = saved_bytes(model, lambda: model(batch.latents, t, batch, extra.get(cfg.architecture)))
    return measured, batch.latents.shape[0], samples * cfg.max_text_len


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_activation_formula_matches_saved_tensors(family, size):
    hidden, layers, text_len, video, ffn = SIZES[size]
    cfg = model_config(family, hidden, layers, text_len, ffn)
    measured, tokens, text_tokens = measure(cfg, video)
    predicted = activation_bytes(cfg, tokens, text_tokens).saved
    assert abs(predicted / measured - 1) < 0.15, f"{family} {size}: formula {predicted:.0f}, measured {measured}"


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
