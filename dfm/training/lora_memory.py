"""State bytes per rank of a LoRA fine-tune against a full one, from the memory plan's formula.

    python -m dfm.training.lora_memory --preset Wan2.1-T2V-1.3B --rank 16 32 64

Counts come from the preset built on meta with the adapters (``peft.target_modules``' default: the
attention projections); bytes for bf16 and Adam on one GPU (DDP).
"""

from __future__ import annotations

import argparse
import dataclasses

from dfm.training.memory import RankBytes, bytes_per_parameter, state_formula


def state_bytes(total: int, trainable: int | None, layout: str = "ddp", shards: int = 1) -> RankBytes:
    """bf16 + Adam RankBytes of ``total`` parameters, ``trainable`` of them trained (None: all)."""
    per = bytes_per_parameter("bf16", True, "adam", layout not in ("ddp", "distributed_optimizer"))
    return state_formula(total, per, layout, shards, trainable)


def main(argv: list[str] | None = None) -> None:
    from dfm.config.container import ModelConfig
    from dfm.config.peft import PeftConfig
    from dfm.config.presets import PRESETS
    from dfm.convert.lora import family_rules
    from dfm.peft.memory import lora_parameter_counts
    from dfm.platform.distributed import destroy_distributed, initialize_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="Wan2.1-T2V-1.3B", choices=list(PRESETS))
    parser.add_argument("--rank", type=int, nargs="+", default=[16, 32, 64])
    args = parser.parse_args(argv)
    model_cfg = ModelConfig(**{**PRESETS[args.preset], "attention_backend": "sdpa"})
    initialize_distributed()
    try:
        for rank in args.rank:
            peft = dataclasses.replace(PeftConfig(), lora_rank=rank)
            total, adapters = lora_parameter_counts(model_cfg, peft, family_rules(model_cfg))
            full, lora = state_bytes(total - adapters, None), state_bytes(total, adapters)
            print(f"{args.preset} rank {rank}: {adapters} adapter parameters on {total - adapters}")
            print(f"  full fine-tune: {full.describe()}")
            print(f"  LoRA:           {lora.describe()}; optimizer {lora.optimizer / full.optimizer:.2%} of full")
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
