"""The ``peft`` config section (LoRA rank, scaling, dropout, targets) and how adapter parameters are named."""

from __future__ import annotations

from dataclasses import dataclass, field

# What diffusers' Wan and FLUX LoRA recipes train: the attention projections.
DEFAULT_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


@dataclass
class PeftConfig:
    """LoRA adapters W x + (alpha / rank) B A x on the linears ``target_modules`` names.

    ``target_modules``: diffusers module names, matched as peft does (the whole name or its
    dotted suffix: ``to_q``, ``attn1.to_out.0``, ``ffn.net.0.proj``, ``add_q_proj``, ...), mapped
    onto dfm's fused megatron layers by the family's conversion rules; for families without a
    diffusers counterpart (DiT), dfm's own module names (``linear_qkv``, ``linear_proj``, ...).
    """

    lora_rank: int = 0  # 0: no adapters (full fine-tune)
    lora_alpha: float | None = None  # None: lora_rank (scaling 1)
    lora_dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    freeze_base: bool = True

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0

    @property
    def scaling(self) -> float:
        """alpha / rank: the factor on B A x."""
        return (self.lora_alpha if self.lora_alpha is not None else self.lora_rank) / self.lora_rank


ADAPTER = "lora"  # an adapter's attribute on its linear: parameters '<linear>.lora.A.<part>', '.B.<part>'


def is_adapter_param(name: str) -> bool:
    """A LoRA adapter's parameter (or state-dict key), by name (dfm/peft)."""
    return f".{ADAPTER}." in f".{name}"
