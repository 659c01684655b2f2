"""dfm's MLP activation region (dfm/models/common/activation_mlp.py): the one-region SwiGLU and the
recomputed activation give the unfused gradients (float64), keep fewer bytes for backward, and a tiny
model trains the same with ``model.recompute_activation`` on and off (also under full recompute)."""

import pytest
import torch
import torch.nn.functional as F

from benchmarks.activations import saved_bytes
from dfm.models.common.activation_mlp import SwiGLU, activation_region
from dfm.models.common.fused import swiglu, swiglu_grad
from dfm.models.common.rebuilt import through_rebuilt
from tests.models._helpers import build_random_model, conditioning, make_samples, pack_samples, tiny_config


def unfused_swiglu(y):
    """megatron's unfused gated path (glu_linear_offset 0)."""
    y1, y2 = torch.chunk(y, 2, dim=-1)
    return F.silu(y1) * (y2 + 0.0)


def test_swiglu_region_gradients_equal_unfused_float64():
    y = torch.randn(7, 2, 12, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: SwiGLU.apply(t, swiglu, swiglu_grad), (y,))
    grad = torch.randn(7, 2, 6, dtype=torch.float64)
    (fused,) = torch.autograd.grad(activation_region(True, False)(y), y, grad)
    (unfused,) = torch.autograd.grad(unfused_swiglu(y), y, grad)
    torch.testing.assert_close(fused, unfused, rtol=1e-12, atol=1e-12)


def mlp(x, w1, w2, act, recompute: bool):
    y = x @ w1
    if not recompute:
        return act(y) @ w2
    return through_rebuilt(lambda a: a @ w2, act, y)


@pytest.mark.parametrize("gated", [False, True])
def test_recomputed_activation_gradients_equal_and_keep_less_float64(gated):
    gen = torch.Generator().manual_seed(0)
    w1 = torch.randn(8, 32 if gated else 16, dtype=torch.float64, generator=gen, requires_grad=True)
    w2 = torch.randn(16, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    x = torch.randn(5, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    act = activation_region(gated, False)
    results, kept = [], []
    for recompute in (False, True):
        holder = torch.nn.ParameterList([w1, w2])
        kept.append(saved_bytes(holder, lambda r=recompute: results.append(mlp(x, w1, w2, act, r))))
    grads = [torch.autograd.grad(out.square().sum(), (x, w1, w2)) for out in results]
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert kept[0] - kept[1] == 5 * 16 * 8  # the activation's output [5, 16] float64 is not kept


def outputs_and_grads(model, pack):
    c_noise, labels = conditioning(pack.num_samples)
    out = model(pack.latents, c_noise, pack, labels)
    out.square().mean().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads


@pytest.mark.parametrize(
    "name, extra",
    [("moviegen", {}), ("dit_cross", dict(recompute_granularity="full"))],  # SwiGLU; GELU in a checkpointed layer
)
def test_recompute_activation_trains_the_same(dist, name, extra):
    pack = pack_samples(make_samples(tiny_config(name))[:2], segment_multiple=8)
    base_out, base_grads = outputs_and_grads(build_random_model(tiny_config(name)), pack)
    out, grads = outputs_and_grads(build_random_model(tiny_config(name, recompute_activation=True, **extra)), pack)
    torch.testing.assert_close(out, base_out, rtol=0, atol=0)
    assert grads.keys() == base_grads.keys()
    for key, grad in base_grads.items():
        torch.testing.assert_close(grads[key], grad, rtol=1e-6, atol=1e-7, msg=key)


def test_tanh_gelu_writes_its_gradient_into_the_incoming_one_with_f_gelus_values():
    """F.gelu's forward (through one sigmoid on the CPU: to float32 rounding) and bit for bit its backward;
    the backward's result is the incoming gradient's memory when that is a plain dense tensor, a new
    tensor for an expanded one (a sum's gradient)."""
    from dfm.models.common.fused import gelu_tanh_grad_in_place

    x = torch.randn(64, 1, 48, requires_grad=True)
    grad = torch.randn(64, 1, 48)
    expected_out = F.gelu(x, approximate="tanh")
    (expected,) = torch.autograd.grad(expected_out, x, grad)
    out = gelu_tanh_grad_in_place(x)
    incoming = grad.clone()
    (got,) = torch.autograd.grad(out, x, incoming)
    torch.testing.assert_close(out, expected_out, rtol=1e-6, atol=1e-6)
    assert torch.equal(got, expected)
    assert got.data_ptr() == incoming.data_ptr()  # written in place: no new [s, b, f] tensor
    (from_sum,) = torch.autograd.grad(gelu_tanh_grad_in_place(x).sum(), x)
    torch.testing.assert_close(from_sum, torch.autograd.grad(F.gelu(x, approximate="tanh").sum(), x)[0])
    xd = torch.randn(8, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(gelu_tanh_grad_in_place, (xd,))  # a graph of the backward: not in place


def test_one_sigmoid_kernels_equal_torchs_own():
    """one_sigmoid.py against F.gelu and silu's own kernels: float64 to rounding, float32 as close as
    F.gelu itself is to float64; bfloat16 is not routed there."""
    from dfm.models.common.one_sigmoid import (
        gelu_tanh_one_sigmoid,
        gelu_tanh_one_sigmoid_differentiable,
        swiglu_grad_one_sigmoid,
        transcendental_bound,
    )

    x = torch.linspace(-12, 12, 4001, dtype=torch.float64)
    exact = F.gelu(x, approximate="tanh")
    torch.testing.assert_close(gelu_tanh_one_sigmoid(x), exact, rtol=1e-14, atol=1e-14)
    ours, torchs = gelu_tanh_one_sigmoid(x.float()).double(), F.gelu(x.float(), approximate="tanh").double()
    assert (ours - exact).abs().max() <= 2 * (torchs - exact).abs().max()
    assert torch.equal(gelu_tanh_one_sigmoid_differentiable(x.float()), gelu_tanh_one_sigmoid(x.float()))  # compiled
    y = torch.randn(7, 2, 12, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(7, 2, 6, dtype=torch.float64)
    (expected,) = torch.autograd.grad(unfused_swiglu(y), y, grad)
    torch.testing.assert_close(swiglu_grad_one_sigmoid(grad, y.detach()), expected, rtol=1e-13, atol=1e-13)
    assert transcendental_bound(x) and not transcendental_bound(x.bfloat16())
