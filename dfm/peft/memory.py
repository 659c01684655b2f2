"""Parameter counts of a LoRA model, for the memory plan (dfm/training/lora_memory.py prints it)."""

from __future__ import annotations

import torch

from dfm.config.peft import PeftConfig


def lora_parameter_counts(model_cfg, peft: PeftConfig, rules) -> tuple[int, int]:
    """(all parameters, adapter parameters) of the whole model with ``peft``'s adapters (``rules``:
    the family's, ``dfm.convert.lora.family_rules``); built on meta, no memory; needs megatron's
    parallel state."""
    from dfm.models.build import build_model
    from dfm.peft.inject import add_lora

    with torch.device("meta"):
        model, _ = build_model(model_cfg, "bf16")
    add_lora(model, peft, model_cfg, rules, seed=0)
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
