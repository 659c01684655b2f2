"""What a LoRA run needs of the families: the rules its adapters are named by (the diffusers names of a
family with a diffusers counterpart), the adapters on an empty model before a checkpoint loads, and
the LoRA files an ``export-lora`` writes (dfm/peft holds the adapters themselves; docs/lora.md)."""

from __future__ import annotations

from torch import Tensor

from dfm.convert.flux import flux_rules
from dfm.convert.rules import Rule
from dfm.convert.wan import expert_lora_files
from dfm.convert.wan import rules as wan_rules
from dfm.peft.inject import add_lora


def family_rules(model_cfg) -> list[Rule] | None:
    """The conversion rules of a family with a diffusers counterpart (its LoRA targets are diffusers
    names), None for the others (targets are dfm's module names)."""
    if model_cfg.architecture == "wan":
        return wan_rules(model_cfg)
    if model_cfg.architecture == "flux":
        return flux_rules(model_cfg)
    return None


def adapters_of(cfg):
    """For ``load_model``: puts a LoRA run's adapters on the empty model before its checkpoint loads
    (None when ``cfg`` trains no adapters)."""
    if not cfg.peft.enabled:
        return None
    return lambda model: add_lora(model, cfg.peft, cfg.model, family_rules(cfg.model), cfg.rng.seed)


def lora_files(cfg, weights: dict[str, Tensor]) -> list[tuple[str, dict[str, Tensor], str]]:
    """(subfolder of the output, its model's weights, the diffusers call that loads it) per LoRA file: one,
    or for Wan 2.2 experts each expert's into its own transformer (dfm/convert/wan.py)."""
    if cfg.model.architecture == "wan" and cfg.model.wan_expert is not None:
        return expert_lora_files(cfg.model.wan_expert, weights)
    return [("", weights, 'pipeline.load_lora_weights("{}")')]
