"""A LoRA run's state per rank: gradients and optimizer state for the adapters only.

The plan's formula (dfm.training.memory.state_formula) for a Wan-1.3B-shaped model built on meta
with rank-32 adapters on the attention projections gives optimizer bytes <= 2% of a full fine-tune's;
tests/peft/test_lora_layouts.py checks the formula against what tiny LoRA runs measure.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from dfm.config.container import ModelConfig
from dfm.config.peft import PeftConfig
from dfm.config.presets import PRESETS
from dfm.convert.lora import family_rules
from dfm.peft.memory import lora_parameter_counts
from dfm.training.lora_memory import state_bytes
from tests.models.conftest import dist  # noqa: F401  (one-process megatron state)


def test_wan_1_3b_lora_optimizer_state_is_under_2_percent_of_a_full_fine_tune(dist):  # noqa: F811
    model_cfg = ModelConfig(**{**PRESETS["Wan2.1-T2V-1.3B"], "attention_backend": "sdpa"})
    peft = dataclasses.replace(PeftConfig(), lora_rank=32)
    total, adapters = lora_parameter_counts(model_cfg, peft, family_rules(model_cfg))
    # 30 blocks x 2 attentions x 4 projections x r (1536 + 1536)
    assert adapters == 30 * 2 * 4 * 32 * (1536 + 1536)
    for layout, shards in (("ddp", 1), ("distributed_optimizer", 8), ("optim_grads_params", 8)):
        full, lora = (
            state_bytes(total - adapters, None, layout=layout, shards=shards),
            state_bytes(total, adapters, layout=layout, shards=shards),
        )
        assert lora.optimizer <= 0.02 * full.optimizer, (layout, lora, full)
        assert lora.grads <= 0.02 * full.grads


def assert_measured_matches_formula(log_dir: Path) -> None:
    """Every rank of a LoRA run holds the gradients and optimizer state the formula gives its adapters."""
    record = json.loads((log_dir / "memory_per_rank.json").read_text())
    for rank in record["ranks"]:
        assert 0 < rank["trainable"] < rank["parameters"]
        assert rank["measured"]["optimizer"] == rank["formula"]["optimizer"], rank
        assert rank["measured"]["grads"] == rank["formula"]["grads"], rank
