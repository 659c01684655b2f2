"""``model.compile=true``: the blocks' compiled elementwise regions give the eager model's outputs and
gradients for every family, and packs of changing length reuse the graphs instead of recompiling.

The family-wide test compiles through AOT autograd without code generation (``aot_eager``: the same
graph capture, dynamic shapes and decompositions, seconds instead of minutes on a 2-core CPU); the
fused functions themselves also go through inductor's code generation once.
"""

import pytest
import torch
import torch._dynamo

from dfm.models.common import fused
from tests.models._helpers import (
    ARCHITECTURES,
    build_random_model,
    conditioning,
    make_sample,
    pack_samples,
    tiny_config,
)

# Packs with different total lengths and sample counts (an image among videos; different text lengths).
PACK_SHAPES = [
    [((3, 4, 6), 5), ((1, 6, 4), 9)],
    [((2, 4, 4), 3), ((4, 2, 4), 7), ((1, 4, 4), 4)],
    [((2, 6, 6), 6)],
    [((1, 2, 4), 2), ((3, 4, 4), 8), ((2, 2, 2), 5), ((1, 6, 6), 3)],
]


@pytest.fixture
def aot_eager(monkeypatch):
    """Compile regions with AOT autograd but no code generation; fresh compiled copies per test."""

    compile_region = fused.compile_region
    monkeypatch.setattr(fused, "compile_region", lambda fn, backend="inductor": compile_region(fn, "aot_eager"))
    fused.compiled_block_ops.cache_clear()
    fused.compiled_activation.cache_clear()
    torch._dynamo.reset()
    yield
    fused.compiled_block_ops.cache_clear()
    fused.compiled_activation.cache_clear()
    torch._dynamo.reset()


def packs(cfg):
    index = 0
    for shapes in PACK_SHAPES:
        samples = []
        for thw, text_len in shapes:
            samples.append(make_sample(index, thw, text_len, cfg))
            index += 1
        yield pack_samples(samples, segment_multiple=8)


def unique_graphs() -> int:
    """Graphs dynamo has captured in this process so far."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def outputs_and_grads(model, pack) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    c_noise, labels = conditioning(pack.num_samples)
    out = model(pack.latents, c_noise, pack, labels)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    (out * weights * pack.loss_mask[:, None]).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.detach(), grads


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_compiled_blocks_equal_eager(dist, aot_eager, name):
    eager = build_random_model(tiny_config(name))
    compiled = build_random_model(tiny_config(name, compile=True))
    for index, pack in enumerate(packs(tiny_config(name))):
        before = unique_graphs()
        out_eager, grads_eager = outputs_and_grads(eager, pack)
        assert unique_graphs() == before, f"{name}: the eager model compiled"
        out_compiled, grads_compiled = outputs_and_grads(compiled, pack)
        if index == 0:  # the compiled path is taken (falling back to eager would compile nothing)
            assert unique_graphs() > before, f"{name}: model.compile=true compiled no region"
        torch.testing.assert_close(out_compiled, out_eager, rtol=1e-5, atol=1e-6)
        assert grads_compiled.keys() == grads_eager.keys()
        for key, grad in grads_eager.items():
            # Relative to the tensor's scale: fused kernels round differently inside long gradient sums.
            error, scale = (grads_compiled[key] - grad).abs().max().item(), grad.abs().max().item()
            assert error <= 1e-4 * max(scale, 1e-6), f"{key}: max error {error:.3g} at scale {scale:.3g}"


@pytest.mark.slow
def test_changing_pack_lengths_reuse_the_graphs(dist, aot_eager):
    """After the first pack, packs of other lengths and sample counts compile nothing new."""
    cfg = tiny_config("dit_cross", compile=True)
    model = build_random_model(cfg)
    graphs = []
    for pack in packs(cfg):
        outputs_and_grads(model, pack)
        graphs.append(unique_graphs())
    assert graphs[0] > 0 and graphs[1:] == [graphs[0]] * (len(graphs) - 1), graphs


@pytest.mark.slow
def test_inductor_fused_regions_equal_eager():
    """Inductor's generated kernels for the block regions (norm + modulate and gated residual on
    per-sample rows, the ungated residual), at two lengths, forward and backward."""
    torch._dynamo.reset()
    compiled = fused.BlockOps(fused.compile_region(fused.residual), *fused.compiled_rows_ops("inductor"))
    gen = torch.Generator().manual_seed(0)
    for length in (37, 90):
        x, out = (torch.randn(length, 1, 16, generator=gen, requires_grad=True) for _ in range(2))
        shift, scale, gate = (torch.randn(3, 16, generator=gen, requires_grad=True) for _ in range(3))
        bias = torch.randn(16, generator=gen, requires_grad=True)
        ids = torch.randint(0, 3, (length,), generator=gen)
        results = []
        for ops in (fused.BlockOps(), compiled):
            normed = ops.norm_modulate_rows(x, shift, scale, ids, 1e-6, False)
            y = ops.residual(ops.gated_residual_rows(x, gate, ids, normed * out, bias), out, bias)
            grads = torch.autograd.grad(y.square().sum(), (x, shift, scale, gate, out, bias))
            results.append((y, grads))
        (y_eager, g_eager), (y_compiled, g_compiled) = results
        torch.testing.assert_close(y_compiled, y_eager, rtol=1e-5, atol=1e-5)
        for a, b in zip(g_compiled, g_eager):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("gated", [True, False])
def test_inductor_activation_regions_equal_eager(gated):
    """The MLP's activation region through inductor's CPU code generation (model.compile=true on the CPU):
    it compiles, and equals the eager region (one sigmoid there, torch's kernels or its own fusion here)."""
    from dfm.models.common.activation_mlp import activation_region

    torch._dynamo.reset()
    fused.compiled_activation.cache_clear()
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(37, 1, 24 if gated else 12, generator=gen, requires_grad=True)
    grad = torch.randn(37, 1, 12, generator=gen)
    results = []
    for compile in (False, True):
        out = activation_region(gated, compile)(y)
        results.append((out, *torch.autograd.grad(out, y, grad.clone())))  # eager GELU writes into it
    for compiled, eager in zip(results[1], results[0]):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    fused.compiled_activation.cache_clear()
    torch._dynamo.reset()
