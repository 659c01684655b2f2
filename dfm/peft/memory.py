"""Parameter counts of a LoRA model, for the memory plan (dfm/training/memory_plan.py).

    python -m dfm.peft.memory --preset Wan2.1-T2V-1.3B --rank 64

prints, per rank, the state bytes (parameters, gradients, optimizer) of a full fine-tune and of LoRA
on one GPU (bf16, Adam, DDP), from the plan's formula with the counts of the model built on meta.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from dfm.peft.config import PeftConfig


def lora_parameter_counts(model_cfg, peft: PeftConfig) -> tuple[int, int]:
    """(all parameters, adapter parameters) of the whole model with ``peft``'s adapters; built on
    meta (no memory); needs megatron's parallel state."""
    from dfm.models.build import build_model
    from dfm.peft.inject import add_lora

    with torch.device("meta"):
        model, _ = build_model(model_cfg, "bf16")
    add_lora(model, peft, model_cfg, seed=0)
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def state_bytes(total: int, trainable: int | None, precision: str = "bf16", layout: str = "ddp", shards: int = 1):
    """RankBytes of ``total`` parameters, ``trainable`` of them trained (None: all), Adam."""
    from dfm.training.memory import bytes_per_parameter, state_formula

    per = bytes_per_parameter(precision, True, "adam", layout not in ("ddp", "distributed_optimizer"))
    return state_formula(total, per, layout, shards, trainable)


def main(argv: list[str] | None = None) -> None:
    from dfm.config.container import ModelConfig
    from dfm.config.presets import PRESETS
    from dfm.platform.distributed import destroy_distributed, initialize_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="Wan2.1-T2V-1.3B", choices=list(PRESETS))
    parser.add_argument("--rank", type=int, nargs="+", default=[16, 32, 64])
    args = parser.parse_args(argv)
    model_cfg = ModelConfig(**{**PRESETS[args.preset], "attention_backend": "sdpa"})
    initialize_distributed()
    try:
        for rank in args.rank:
            total, adapters = lora_parameter_counts(model_cfg, dataclasses.replace(PeftConfig(), lora_rank=rank))
            full, lora = state_bytes(total - adapters, None), state_bytes(total, adapters)
            print(f"{args.preset} rank {rank}: {adapters} adapter parameters on {total - adapters}")
            print(f"  full fine-tune: {full.describe()}")
            print(f"  LoRA:           {lora.describe()}; optimizer {lora.optimizer / full.optimizer:.2%} of full")
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
