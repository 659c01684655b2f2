"""``attention_backend=auto`` follows the device the model is built for, not the host: on a faked GPU
host (CUDA, TE and torch's varlen kernel all "available"), a model converted, loaded for generation or
built for training on the CPU runs SDPA; a CUDA device gets TE, else varlen."""

from __future__ import annotations

import pytest
import torch

from dfm.config.errors import ConfigError
from dfm.config.recipes import get_recipe
from dfm.config.validate import validate_config
from dfm.convert.pretrained import save_pretrained_checkpoint
from dfm.convert.weights import converted_model
from dfm.inference.checkpoint_loading import load_model, single_process_config
from dfm.models import build
from dfm.models.attention.core import PackedDotProductAttention
from dfm.parallel.layout import ParallelLayout
from dfm.training import setup


@pytest.fixture
def gpu_host(dist, monkeypatch):
    """Every host-level check says GPU; TE "imports" (building its layers here would fail loudly).
    The one-process world starts first (on gloo, as the real host is a CPU one)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(build, "transformer_engine_available", lambda: True)


def backends(model: torch.nn.Module) -> set[str]:
    found = {m.backend for m in model.modules() if isinstance(m, PackedDotProductAttention)}
    assert found, "no attention module found"
    return found


def tiny_weights(cfg) -> dict[str, torch.Tensor]:
    model, _ = build.build_model(cfg.model, "fp32")
    return {model.global_param_name(n): p.detach().clone() for n, p in model.named_parameters()}


def test_auto_resolves_from_the_device(gpu_host, monkeypatch):
    assert build.resolve_attention_backend("auto", torch.device("cpu")) == "sdpa"
    assert build.resolve_attention_backend("auto", "cuda:0") == "te"
    monkeypatch.setattr(build, "transformer_engine_available", lambda: False)
    assert build.resolve_attention_backend("auto", torch.device("cuda", 0)) == "varlen"
    assert build.resolve_attention_backend("flex", "cpu") == "flex"


def test_fp32_on_cuda_takes_flex_and_varlen_asks_for_half_precision(gpu_host, monkeypatch):
    """torch's flash kernels take bf16 / fp16 only: auto gave varlen to the fp32 digits rungs on an H200
    (2026-11-29), whose first step raised 'FlashAttention only support fp16 and bf16 data type'."""
    monkeypatch.setattr(build, "transformer_engine_available", lambda: False)
    assert build.resolve_attention_backend("auto", "cuda:0", "fp32") == "flex"
    assert build.resolve_attention_backend("auto", "cuda:0", "fp16") == "varlen"
    cfg = get_recipe("dit_tiny")
    cfg.model.attention_backend = "varlen"
    with pytest.raises(ConfigError, match="varlen .* takes bf16 or fp16, not mixed_precision.precision=fp32"):
        validate_config(cfg)


def test_conversion_and_generation_on_the_cpu_of_a_gpu_host_use_sdpa(gpu_host, tmp_path):
    cfg = get_recipe("dit_tiny")
    assert cfg.model.attention_backend == "auto"
    weights = tiny_weights(cfg)
    with converted_model(cfg.model, weights, cfg.rng.seed) as model:  # convert_*.py --verify
        assert backends(model) == {"sdpa"}
    directory = save_pretrained_checkpoint(cfg, weights, tmp_path)
    # generation's model load (inference/generate.py) on a CPU device
    assert backends(load_model(single_process_config(cfg), directory, torch.device("cpu"))) == {"sdpa"}


def test_a_cpu_training_build_on_a_gpu_host_uses_sdpa(gpu_host, monkeypatch):
    cfg = get_recipe("dit_tiny")
    seen = []
    resolve = build.resolve_attention_backend
    monkeypatch.setattr(
        build, "resolve_attention_backend", lambda req, dev, prec: seen.append(dev) or resolve(req, dev, prec)
    )
    chunks, _ = setup.build_model(cfg, ParallelLayout.from_config(cfg.model, 1), torch.device("cpu"))
    assert backends(chunks[0]) == {"sdpa"} and seen == [torch.device("cpu")]
