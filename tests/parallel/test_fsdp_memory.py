"""Per-rank memory of parameters, gradients and optimizer state (dfm.training.memory, benchmarks.memory):
full sharding over 4 data-parallel ranks holds at most 0.3x what one unsharded rank holds, for the
DiT-28B preset's real parameter shapes (built on the meta device). The formula against what the ranks of
a real Megatron-FSDP run hold: tests/parallel/test_fsdp_resume.py::test_measured_bytes_per_rank_match_the_formula."""

from __future__ import annotations

import pytest

from benchmarks.memory import format_rows, memory_rows, parameter_shapes
from dfm.training.memory import bytes_per_parameter, formula_bytes, shape_bytes


@pytest.fixture(scope="module")
def dit_28b_rows():
    return memory_rows("DiT-28B", parameter_shapes("DiT-28B"), dps=(1, 2, 4))


def test_full_sharding_at_dp4_holds_under_a_third(dit_28b_rows):
    by_key = {(row.dp, row.layout): row for row in dit_28b_rows}
    unsharded = by_key[(1, "ddp")].from_shapes.total
    fsdp = by_key[(4, "optim_grads_params")].from_shapes.total
    assert fsdp <= 0.3 * unsharded, format_rows(dit_28b_rows)
    # The distributed optimizer shards the optimizer state alone: 2 + 4 + 12 / 4 bytes of 18.
    assert by_key[(4, "distributed_optimizer")].fraction == pytest.approx(9 / 18, abs=1e-3)


def test_shapes_agree_with_the_formula(dit_28b_rows):
    for row in dit_28b_rows:
        # Rank 0 rounds each parameter's rows up: a hair above the closed form, never below.
        assert row.formula.total <= row.from_shapes.total <= row.formula.total * 1.001, row


def test_bytes_per_parameter_by_precision():
    assert bytes_per_parameter("bf16", True, "adam", fsdp=False).__dict__ == {"params": 2, "grads": 4, "optimizer": 12}
    # fp32 parameters are their own main weights, except in Megatron-FSDP's separate fp32 buffer.
    assert bytes_per_parameter("fp32", True, "adam", fsdp=False).optimizer == 8
    assert bytes_per_parameter("fp32", True, "adam", fsdp=True).optimizer == 12


def test_uneven_rows_go_to_rank_zero():
    per = bytes_per_parameter("bf16", True, "adam", fsdp=True)
    # 5 rows of 3 over 4 ranks: rank 0 holds 2 rows (6 elements), the formula 15 / 4 elements.
    assert shape_bytes([(5, 3)], per, "optim_grads_params", 4).params == 6 * 2
    assert formula_bytes(15, per, "optim_grads_params", 4).params == 15 * 2 // 4
