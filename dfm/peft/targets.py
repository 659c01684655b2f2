"""Which dfm linears get adapters, and which rows of each come from which diffusers module.

A LoRA file names diffusers modules (``blocks.0.attn1.to_q``); dfm fuses several of them into one
megatron linear (``layers.0.self_attention.linear_qkv`` holds to_q, to_k and to_v, interleaved per
head). The family's conversion rules (dfm/convert) already say how: a rule's ``split`` takes the
dfm weight apart into the diffusers tensors, so splitting the row indices ``arange(out)`` gives,
for every part, the dfm rows it occupies. Each targeted part keeps its own A and B, as in the
diffusers model, so the adapters are exactly diffusers' whatever the fusion.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dfm.peft.errors import PeftError

WEIGHT = ".weight"


def matches(name: str, targets: Sequence[str]) -> bool:
    """peft's rule: a target names the whole module name or a dotted suffix of it."""
    return any(name == target or name.endswith(f".{target}") for target in targets)


def _whole(tensor: Tensor) -> list[Tensor]:
    return [tensor]


@dataclass(frozen=True)
class LoraTarget:
    """One dfm linear (global module name) whose weight rows are made of ``parts`` (diffusers module
    names, in rule order; dfm's own name for families without a diffusers counterpart)."""

    module: str
    parts: tuple[str, ...]
    targeted: tuple[bool, ...]
    split: Callable[[Tensor], list[Tensor]] = _whole  # the rule's: dfm weight -> the parts' tensors

    def part_rows(self, out_features: int) -> list[Tensor]:
        """[n_s] long per part: the dfm weight rows holding part s's rows, in the part's order."""
        index = torch.arange(out_features)[:, None]
        try:
            pieces = self.split(index)
        except RuntimeError as error:
            raise PeftError(f"{self.module}: its rule does not map whole rows ({error}): no LoRA there") from None
        rows = [piece.reshape(-1) for piece in pieces]
        covered = torch.cat(rows).sort().values
        if len(rows) != len(self.parts) or not torch.equal(covered, torch.arange(out_features)):
            raise PeftError(f"{self.module}: its rule does not map rows one to one onto {self.parts}: no LoRA there")
        return rows


def rule_targets(rules, target_modules: Sequence[str]) -> tuple[dict[str, LoraTarget], set[str]]:
    """({dfm module: target} for every rule of a weight whose diffusers modules a target names,
    the diffusers modules matched)."""
    found, matched = {}, set()
    for rule in rules:
        if not all(name.endswith(WEIGHT) for name in (rule.dfm, *rule.diffusers)):
            continue
        parts = tuple(name.removesuffix(WEIGHT) for name in rule.diffusers)
        targeted = tuple(matches(part, target_modules) for part in parts)
        if any(targeted):
            module = rule.dfm.removesuffix(WEIGHT)
            found[module] = LoraTarget(module, parts, targeted, rule.split)
            matched.update(part for part, hit in zip(parts, targeted) if hit)
    return found, matched


def lora_targets(
    model_cfg, target_modules: Sequence[str], module_names: Sequence[str], rules: Sequence | None
) -> dict[str, LoraTarget]:
    """{dfm global module name: target}. ``rules``: the family's conversion rules (dfm/convert), None
    for a family without a diffusers counterpart, whose targets are dfm's names among ``module_names``
    (the global names of the model's linears)."""
    if rules is None:
        found = {name: LoraTarget(name, (name,), (True,)) for name in module_names if matches(name, target_modules)}
        matched = set(found)
    else:
        found, matched = rule_targets(rules, target_modules)
    unused = [target for target in target_modules if not any(matches(name, [target]) for name in matched)]
    if unused:
        vocabulary = "dfm's module names" if rules is None else "diffusers' module names"
        raise PeftError(f"peft.target_modules {unused} name no linear of {model_cfg.architecture} ({vocabulary})")
    return found
