"""The lean block's autograd Functions on the device: fp32 there equals the same op on the CPU
(forward and every input gradient), and bf16 stays close to fp32.

The CPU tests (tests/models/test_lean_block.py, test_activation_mlp.py, test_packed_attention.py)
prove each Function equal to the unfused ops with float64 gradchecks; here the device's own kernels
run them: the one-hot GEMM that sums per-token grads into rows on CUDA (row_modulation.py), the fused
RMSNorm / LayerNorm kernels with their statistics, RoPE tables made on the device, SDPA's CUDA
kernels per segment (sdpa.py's non-CPU branch); and the regions ``model.compile=true`` compiles, as
inductor generates them for the device, against the eager Functions.

fp32 tolerance 1e-5: the same math, only the reduction order and kernels differ (TF32 is off for
matmuls by default). bf16 tolerance: max |bf16 - fp32| <= 2e-2 * max |fp32| per output and per
gradient, both runs on the same bf16-rounded inputs. bf16 keeps 8 significant bits (unit roundoff
2^-9 ~ 2e-3); these Functions round each intermediate once (gather, multiply, add, the output
cast; norms and softmax reduce in fp32), at most ~4 roundings on a path: <= ~1e-2 of the output's
scale. 2e-2 leaves a factor 2 and still catches a wrong formula (errors of order 1 x scale).
"""

from __future__ import annotations

import pytest
import torch

from dfm.models.attention import sdpa_per_segment
from dfm.models.attention.qk_norm_rope import qk_norm_rope
from dfm.models.attention.rope_tables import RotaryTables
from dfm.models.common.activation_mlp import activation_region
from dfm.models.common.adaln import rows_to_tokens, sum_rows_by_one_hot_gemm
from dfm.models.common.fused import compiled_block_ops
from dfm.models.common.norm_recompute import norm_modulate_rows, norm_recomputed
from dfm.models.common.row_modulation import gated_residual_rows
from tests.gpu._device import DEVICE, GPU
from tests.models._helpers import segments_on
from tests.models.test_lean_block import PACK_IDS, H, rand
from tests.models.test_packed_attention import CASES as ATTENTION_CASES

pytestmark = GPU

FP32_TOLERANCE = 1e-5
BF16_TOLERANCE = 2e-2  # of each tensor's max magnitude (module docstring)


def qk_norm_rope_with_tables(x, weight, angles, eps, interleaved):
    """qk_norm_rope with cos / sin made on x's device in x's dtype from fp32 angles, as the model does."""
    cos, sin = RotaryTables(angles, interleaved).cos_sin(x.dtype)
    return qk_norm_rope(x, weight, cos, sin, eps, interleaved)


def packed_sdpa(device, case: str):
    """sdpa_per_segment over one of test_packed_attention's packs, its boundaries on ``device``."""
    q_lens, q_padded, kv_lens, kv_padded = ATTENTION_CASES[case]
    params = segments_on(device, q_lens, q_padded, kv_lens, kv_padded)
    inputs = (
        rand(sum(q_padded), 1, 2, 8),
        rand(sum(kv_padded), 1, 2, 8, seed=1),
        rand(sum(kv_padded), 1, 2, 8, seed=2),
    )
    return (lambda q, k, v: sdpa_per_segment(q, k, v, params, 8**-0.5)), inputs


# name -> device -> (fn, float64 master inputs). Inputs that require grad take the dtype under test;
# other floating tensors (RoPE angles) stay fp32, as the model keeps them; ids are moved as they are.
CASES = {
    **{
        f"norm_modulate_rows_{norm}": lambda device, rms=rms: (
            norm_modulate_rows,
            (rand(len(PACK_IDS), 1, H), rand(4, H, seed=1), rand(4, H, seed=2), PACK_IDS, 1e-6, rms),
        )
        for norm, rms in (("layernorm", False), ("rmsnorm", True))
    },
    "norm_recomputed_rmsnorm": lambda device: (norm_recomputed, (rand(11, 1, H), 1e-6, True)),
    "gated_residual_rows": lambda device: (
        gated_residual_rows,
        (rand(len(PACK_IDS), 1, H), rand(4, H, seed=1), PACK_IDS, rand(len(PACK_IDS), 1, H, seed=2), rand(H, seed=3)),
    ),
    "rows_to_tokens": lambda device: (rows_to_tokens, (rand(4, H), PACK_IDS)),
    "one_hot_row_sums": lambda device: (
        lambda grad, ids: sum_rows_by_one_hot_gemm(grad, ids, 4),
        (rand(len(PACK_IDS), H), PACK_IDS),
    ),
    **{
        f"qk_norm_rope_{kind}": lambda device, interleaved=interleaved: (
            qk_norm_rope_with_tables,
            (rand(5, 1, 3, 8), rand(8, seed=1), rand(5, 1, 1, 8, seed=4).detach() * 6, 1e-6, interleaved),
        )
        for kind, interleaved in (("halves", False), ("interleaved", True))
    },
    "swiglu_region": lambda device: (activation_region(True, False), (rand(7, 2, 12),)),
    "gelu_region": lambda device: (activation_region(False, False), (rand(7, 2, 12),)),
    **{f"sdpa_per_segment_{case}": lambda device, case=case: packed_sdpa(device, case) for case in ATTENTION_CASES},
}


def cast(value, device, dtype, rounding):
    """A master input on ``device``: differentiable tensors rounded to ``rounding`` then in ``dtype``."""
    if not isinstance(value, torch.Tensor):
        return value
    if not value.is_floating_point():
        return value.to(device)
    if not value.requires_grad:
        return value.to(device, torch.float32)
    return value.detach().to(rounding).to(device, dtype).requires_grad_()


# The regions model.compile=true compiles (inductor), by the eager case they must equal.
COMPILED = {
    "norm_modulate_rows_rmsnorm": lambda: compiled_block_ops("inductor").norm_modulate_rows,
    "gated_residual_rows": lambda: compiled_block_ops("inductor").gated_residual_rows,
    "swiglu_region": lambda: activation_region(True, True),
}


def outputs_and_grads(case: str, device, dtype, rounding=torch.float64, fn=None) -> list[torch.Tensor]:
    """[output, d input_i ...] of one case (its function, or ``fn`` on its inputs) as fp32 CPU
    tensors, for a fixed upstream gradient."""
    case_fn, masters = CASES[case](device)
    fn = fn or case_fn
    inputs = [cast(value, device, dtype, rounding) for value in masters]
    out = fn(*inputs)
    upstream = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    upstream = upstream.to(rounding).to(device, dtype)
    differentiable = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = torch.autograd.grad(out, differentiable, upstream)
    return [t.detach().float().cpu() for t in (out, *grads)]


@pytest.mark.parametrize("case", list(CASES))
def test_fp32_on_the_device_equals_the_cpu(case):
    on_device = outputs_and_grads(case, DEVICE, torch.float32)
    on_cpu = outputs_and_grads(case, torch.device("cpu"), torch.float32)
    for index, (got, expected) in enumerate(zip(on_device, on_cpu)):
        torch.testing.assert_close(got, expected, rtol=FP32_TOLERANCE, atol=FP32_TOLERANCE, msg=f"tensor {index}")


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_on_the_device_is_close_to_fp32(case):
    rounded = dict(rounding=torch.bfloat16)
    bf16 = outputs_and_grads(case, DEVICE, torch.bfloat16, **rounded)
    fp32 = outputs_and_grads(case, DEVICE, torch.float32, **rounded)
    for index, (low, full) in enumerate(zip(bf16, fp32)):
        error, scale = float((low - full).abs().max()), float(full.abs().max())
        assert scale > 0 and error <= BF16_TOLERANCE * scale, (index, error, scale)


@pytest.mark.parametrize("case", list(COMPILED))
def test_compiled_regions_on_the_device_equal_eager(case):
    """inductor's code for the device (Triton on CUDA) against the eager Function, fp32."""
    compiled = outputs_and_grads(case, DEVICE, torch.float32, fn=COMPILED[case]())
    eager = outputs_and_grads(case, DEVICE, torch.float32)
    for index, (got, expected) in enumerate(zip(compiled, eager)):
        torch.testing.assert_close(got, expected, rtol=FP32_TOLERANCE, atol=FP32_TOLERANCE, msg=f"tensor {index}")
