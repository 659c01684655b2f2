"""``checkpoint.pretrained`` fills a LoRA model's base from a base checkpoint (no adapters in it) and
leaves the adapters as initialised; a checkpoint missing a base weight is still refused, naming it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dfm.checkpoint.weights_only import load_pretrained, save_weights_only
from dfm.config.container import ConfigContainer
from dfm.config.loader import config_to_dict
from dfm.config.peft import PeftConfig, is_adapter_param
from dfm.convert.lora import family_rules
from dfm.inference.empty_model import empty_model
from dfm.peft.inject import add_lora
from tests.models.conftest import dist  # noqa: F401  (one-process megatron state)
from tests.wan._tiny import tiny_model_config

PEFT = PeftConfig(lora_rank=2, target_modules=["to_q", "to_out.0"])


def lora_model(cfg):
    model, _ = empty_model(cfg, "fp32")
    with torch.no_grad():
        for param in model.parameters():
            param.normal_()
    add_lora(model, PEFT, cfg, family_rules(cfg), seed=0)
    return model


def test_pretrained_base_loads_into_a_lora_model(dist, tmp_path):  # noqa: F811
    cfg = tiny_model_config()
    base, _ = empty_model(cfg, "fp32")
    with torch.no_grad():
        for param in base.parameters():
            param.uniform_()
    save_weights_only(tmp_path / "base", [base], config_to_dict(ConfigContainer(model=cfg)))
    model = lora_model(cfg)
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if is_adapter_param(n)}
    load_pretrained(tmp_path / "base", [SimpleNamespace(module=model)], cfg)
    weights = dict(model.named_parameters())
    assert all(torch.equal(weights[n], p) for n, p in base.named_parameters())
    assert adapters and all(torch.equal(weights[n], p) for n, p in adapters.items())


def test_a_base_checkpoint_missing_a_weight_is_refused(dist, tmp_path):  # noqa: F811
    cfg = tiny_model_config()
    base = lora_model(cfg)
    del base.final_layer.linear.bias  # a base weight the checkpoint will not hold
    base.final_layer.linear.register_parameter("bias", None)
    save_weights_only(tmp_path / "base", [base], config_to_dict(ConfigContainer(model=cfg)))
    with pytest.raises(BaseException) as refused:  # torch.distributed.checkpoint.CheckpointException
        load_pretrained(tmp_path / "base", [SimpleNamespace(module=lora_model(cfg))], cfg)
    # torch.distributed.checkpoint's error holds each rank's failure, naming the key
    assert "final_layer.linear.bias" in str(getattr(refused.value, "failures", refused.value))
