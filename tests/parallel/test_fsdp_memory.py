"""Per-rank memory of parameters, gradients and optimizer state (dfm.training.memory): the bytes per
parameter by precision and Megatron-FSDP's uneven rows, against hand-computed values. The formula
against what the ranks of a real Megatron-FSDP run hold:
tests/parallel/test_fsdp_resume.py::test_measured_bytes_per_rank_match_the_formula."""

from __future__ import annotations

from dfm.training.memory import bytes_per_parameter, formula_bytes, shape_bytes


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
