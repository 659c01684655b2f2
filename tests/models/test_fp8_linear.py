"""FP8 products (``mixed_precision.fp8``, dfm/models/common/fp8_linear.py): exactly the products of the
quantized operands, near the full-precision ones, on the block linears only; a model runs forward and
backward through them. Several ranks: tests/parallel/test_layout_equivalence.py's fp8 case."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dfm.models.build import build_model_chunk
from dfm.models.common import fp8_linear as fp8_module
from dfm.models.common.adaln import ModulationLinear
from dfm.models.common.fp8_linear import E4M3, E5M2, Fp8Recipe, check_fp8_device, fp8_linear, quantize
from dfm.models.common.one_rank_linear import LocalColumnLinear, LocalRowLinear
from tests.models._helpers import conditioning, make_samples, pack_samples, tiny_config


def operands(tokens: int, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 64, generator=gen).to(dtype).requires_grad_()
    weight = (0.1 * torch.randn(48, 64, generator=gen)).to(dtype).requires_grad_()
    bias = torch.randn(48, generator=gen).to(dtype)
    grad = torch.randn(tokens, 48, generator=gen).to(dtype)
    return x, weight, bias, grad


def dequantized(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    quantized, inverse = quantize(x, dtype, None)
    return quantized.float() * inverse


def test_quantize_puts_the_absolute_maximum_on_the_formats_largest_value():
    x = torch.tensor([0.5, -3.0, 1e-3, 2.0])
    for dtype in (E4M3, E5M2):
        quantized, inverse = quantize(x, dtype, None)
        assert quantized.dtype == dtype
        assert quantized.float().abs().max() == torch.finfo(dtype).max
        torch.testing.assert_close(quantized.float() * inverse, x, rtol=0.13, atol=0)
    zeros, inverse = quantize(torch.zeros(3), E4M3, None)  # no NaN from an all-zero tensor
    assert torch.count_nonzero(zeros.float()) == 0 and torch.isfinite(inverse)


@pytest.mark.parametrize("recipe", ["hybrid", "e4m3"])
@pytest.mark.parametrize("tokens", [32, 37])  # 37: the weight gradient's tokens padded to 48
def test_products_are_those_of_the_quantized_operands(recipe, tokens):
    """Forward, input and weight gradients equal fp32 products of the dequantized operands (E4M3 forward,
    the recipe's format for the output gradient): the scales, layouts and padding are right."""
    x, weight, bias, grad = operands(tokens)
    out = fp8_linear(x, weight, bias, Fp8Recipe.named(recipe), None)
    out.backward(grad)
    xq, wq, gq = dequantized(x, E4M3), dequantized(weight, E4M3), dequantized(grad, Fp8Recipe.named(recipe).gradient)
    torch.testing.assert_close(out, xq @ wq.t() + bias, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, gq @ wq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight.grad, gq.t() @ xq, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_track_the_full_precision_linear(dtype):
    """Within FP8's rounding of F.linear (relative Frobenius error; E4M3 has 3 mantissa bits, E5M2 2),
    in the input's dtype; the weight gradient in the weight's."""
    x, weight, bias, grad = operands(256, dtype)
    out = fp8_linear(x, weight, bias, Fp8Recipe.named("hybrid"), None)
    out.backward(grad)
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    F.linear(x64, w64, bias.double()).backward(grad.double())
    assert out.dtype == x.grad.dtype == weight.grad.dtype == dtype

    def relative(got, expected):
        return ((got.double() - expected).norm() / expected.norm()).item()

    assert relative(out, F.linear(x64, w64, bias.double())) < 0.04
    assert relative(x.grad, x64.grad) < 0.1
    assert relative(weight.grad, w64.grad) < 0.1


def test_a_transposed_gradient_is_quantized_row_major():
    """The output gradient autograd hands over may be a transposed view; ``_scaled_mm`` on CUDA takes its first
    operand row-major only (the CPU's reference kernel takes either), so the quantized copy is made row-major."""
    gradient = torch.randn(48, 37).t()
    quantized, _ = quantize(gradient, E5M2, None)
    assert quantized.is_contiguous() and quantized.shape == (37, 48)


def test_a_recipe_name_off_the_list_is_refused_by_name():
    with pytest.raises(ValueError, match=r"mixed_precision\.fp8='e5m2'"):
        Fp8Recipe.named("e5m2")


def test_a_gpu_without_fp8_tensor_cores_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"compute capability >= 8\.9.*A100 has 8\.0"):
        check_fp8_device("hybrid", "cuda")
    check_fp8_device(None, "cuda")  # no fp8: nothing asked
    check_fp8_device("hybrid", "cpu")


def counted(fn, calls: list):
    def call(*args):
        calls.append(1)
        return fn(*args)

    return call


def block_linears(model) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, (LocalColumnLinear, LocalRowLinear))}


@pytest.mark.parametrize("name", ["dit_cross", "moviegen"])
def test_the_block_linears_run_fp8_and_adaln_keeps_its_precision(dist, name, monkeypatch):
    """With fp8 every attention and MLP linear of the block runs ``Fp8Matmul`` (its forward and backward),
    adaLN's rows do not; the model's output and parameter gradients stay finite and near fp32's."""
    cfg = tiny_config(name, hidden_size=64)
    pack = pack_samples(make_samples(cfg), segment_multiple=8)
    c_noise, labels = conditioning(pack.num_samples)
    outputs, grads = {}, {}
    for fp8 in (None, "hybrid"):
        model, _ = build_model_chunk(cfg, "fp32", seed=3, fp8=fp8)
        gen = torch.Generator().manual_seed(0)
        for param in model.parameters():  # adaLN-Zero's zero weights would hide the blocks from the output
            param.data.normal_(std=0.05, generator=gen)
        calls = []
        monkeypatch.setattr(fp8_module, "scaled_mm", counted(fp8_module.scaled_mm, calls))
        out = model(pack.latents, c_noise, pack, labels)
        out.square().mean().backward()
        linears = block_linears(model)
        fp8_ones = {n for n, m in linears.items() if m._fp8_recipe is not None}
        modulation = {n for n, m in linears.items() if isinstance(m, ModulationLinear)}
        assert modulation and fp8_ones.isdisjoint(modulation)
        assert (fp8_ones == set(linears) - modulation) if fp8 else not fp8_ones
        assert len(calls) == 3 * len(fp8_ones)  # each: forward, input and weight gradients
        outputs[fp8] = out.detach()
        grads[fp8] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        monkeypatch.undo()
    assert torch.isfinite(outputs["hybrid"]).all() and torch.isfinite(grads["hybrid"]).all()
    for got, expected in ((outputs["hybrid"], outputs[None]), (grads["hybrid"], grads[None])):
        assert ((got - expected).norm() / expected.norm()).item() < 0.1
