"""FP8 products on the device (``mixed_precision.fp8``, dfm/models/common/fp8_linear.py): cuBLAS's FP8
GEMMs give the products of the quantized operands, and 100 training steps through the entry point stay
within 1% of bf16's losses (issue 43's FP8 item). The CPU proves the same products exactly
(tests/models/test_fp8_linear.py), and layouts (tests/parallel/test_layout_equivalence.py).

Products tolerance: 1e-2 of each result's largest magnitude. The operands are exact FP8 values on both
sides; what differs is the accumulation order and the bf16 rounding of the output (2^-9 relative).
"""

from __future__ import annotations

import math

import pytest
import torch

from dfm.models.common.fp8_linear import E4M3, Fp8Recipe, fp8_linear, quantize
from tests.gpu._device import DEVICE, GPU, subprocess_env
from tests.training.entry import read_metrics, run_entry

pytestmark = GPU

TOLERANCE = 1e-2
STEPS = 100


def dequantized(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    quantized, inverse = quantize(x, dtype, None)
    return quantized.float() * inverse


def assert_close_to_scale(got: torch.Tensor, expected: torch.Tensor) -> None:
    error = (got.float() - expected).abs().max().item()
    assert error <= TOLERANCE * expected.abs().max().item(), (error, expected.abs().max().item())


# 200 tokens: the weight gradient's padded to 208; a transposed view as the output gradient (cuBLAS takes
# its first operand row-major only).
@pytest.mark.parametrize(("tokens", "transposed_grad"), [(256, False), (200, False), (200, True)])
def test_fp8_products_on_the_device_are_those_of_the_quantized_operands(tokens, transposed_grad):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, 256, generator=gen).to(DEVICE, torch.bfloat16).requires_grad_()
    weight = (0.05 * torch.randn(512, 256, generator=gen)).to(DEVICE, torch.bfloat16).requires_grad_()
    grad = torch.randn(tokens, 512, generator=gen).to(DEVICE, torch.bfloat16)
    if transposed_grad:
        grad = grad.t().contiguous().t()
    recipe = Fp8Recipe.named("hybrid")
    out = fp8_linear(x, weight, None, recipe, None)
    out.backward(grad)
    assert out.dtype == x.grad.dtype == weight.grad.dtype == torch.bfloat16
    xq, wq, gq = dequantized(x, E4M3), dequantized(weight, E4M3), dequantized(grad, recipe.gradient)
    assert_close_to_scale(out, xq @ wq.t())
    assert_close_to_scale(x.grad, gq @ wq)
    assert_close_to_scale(weight.grad, gq.t() @ xq)


def test_fp8_losses_stay_within_one_percent_of_bf16_over_100_steps(tmp_path):
    losses = {}
    for name, extra in (("bf16", []), ("fp8", ["mixed_precision.fp8=hybrid"])):
        run = [f"train.train_iters={STEPS}", "mixed_precision.precision=bf16", f"logger.log_dir={tmp_path / name}"]
        result = run_entry(1, [*run, *extra], env=subprocess_env(), timeout=300)
        assert result.returncode == 0, result.stderr[-4000:]
        losses[name] = [r["loss"] for r in read_metrics(tmp_path / name)]
    assert len(losses["fp8"]) == STEPS and all(math.isfinite(loss) for loss in losses["fp8"])
    assert losses["fp8"] == pytest.approx(losses["bf16"], rel=1e-2)
    worst = max(abs(a / b - 1) for a, b in zip(losses["fp8"], losses["bf16"], strict=True))
    print(f"fp8 against bf16 over {STEPS} steps: largest relative loss difference {worst:.2e}")
