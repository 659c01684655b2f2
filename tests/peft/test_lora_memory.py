"""A LoRA run's state per rank: gradients and optimizer state for the adapters only.

The adapters dfm adds to a Wan-1.3B-shaped model built on meta (rank 32 on the attention projections),
counted by hand; ``assert_measured_matches_formula``: what each rank of a tiny LoRA run holds
(tests/peft/test_lora_layouts.py, tests/wan/test_wan22_lora.py) is the formula's gradients and
optimizer state for its adapters alone.
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
from tests.models.conftest import dist  # noqa: F401  (one-process megatron state)


def test_wan_1_3b_rank_32_adapters_by_hand(dist):  # noqa: F811
    model_cfg = ModelConfig(**{**PRESETS["Wan2.1-T2V-1.3B"], "attention_backend": "sdpa"})
    peft = dataclasses.replace(PeftConfig(), lora_rank=32)
    _, adapters = lora_parameter_counts(model_cfg, peft, family_rules(model_cfg))
    # 30 blocks x 2 attentions x 4 projections x r (1536 + 1536)
    assert adapters == 30 * 2 * 4 * 32 * (1536 + 1536)


def assert_measured_matches_formula(log_dir: Path) -> None:
    """Every rank of a LoRA run holds the gradients and optimizer state the formula gives its adapters."""
    record = json.loads((log_dir / "memory_per_rank.json").read_text())
    for rank in record["ranks"]:
        assert 0 < rank["trainable"] < rank["parameters"]
        assert rank["measured"]["optimizer"] == rank["formula"]["optimizer"], rank
        assert rank["measured"]["grads"] == rank["formula"]["grads"], rank
