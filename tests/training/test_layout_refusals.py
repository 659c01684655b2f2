"""The real entry point as 2 ranks refuses a model its parallel layout cannot run: every rank
exits 2 with the message at config time, before any process group or training starts."""

from __future__ import annotations

import re

import pytest
from entry import RECIPE_DIR, run_entry

TP2 = "model.tensor_model_parallel_size=2"


@pytest.mark.slow
@pytest.mark.parametrize(
    "config, overrides, message",
    [
        (
            "dit_tiny",
            ["model.num_attention_heads=1", TP2],
            "model.num_attention_heads (1) must be divisible by model.tensor_model_parallel_size (2)",
        ),
        (
            "moviegen_tiny",
            [TP2],
            "model.num_moe_experts (4) with model.tensor_model_parallel_size (2) needs model.sequence_parallel=true",
        ),
    ],
)
def test_layout_refusal_exits_2_before_training(tmp_path, config, overrides, message):
    conf = RECIPE_DIR / "conf" / f"{config}.yaml"
    result = run_entry(2, [*overrides, f"logger.log_dir={tmp_path}"], config=conf, timeout=120)
    assert result.returncode != 0
    # Every rank stops at the config error; the launcher may stop a rank first to exit 2 before the other
    # prints, so at least one report of each is certain.
    assert re.search(r"exitcode\s*:\s*2\b", result.stderr), result.stderr[-3000:]
    assert f"config error: {message}" in result.stderr, result.stderr[-3000:]
    assert "resolved config" not in result.stderr and not (tmp_path / "metrics.jsonl").exists()
