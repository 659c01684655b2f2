"""torch's fused Adam, which dfm asks for wherever torch has the kernel, updates as the per-parameter
loop torch picks for CPU tensors by default (to a few ulps), and bitwise the same for any split of a
parameter at multiples of 16 elements (the widest CPU vector of fp32): megatron's distributed optimizer
starts each parameter at a multiple of 64 in its buffer and cuts shards at multiples of 128 / gcd(dp, 128)
elements, 16 or more up to 8-way data parallelism. A cut elsewhere can move an element from the
kernel's vector body to its scalar tail, one ulp apart."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dfm.platform.optimizer_steps import step_parameters_together, torch_optimizers

SHAPES = [(16, 8), (8,), (4, 4, 3), (1,), (1003,)]


def trained(params: list[torch.Tensor], flags: dict, optimizer_class=torch.optim.AdamW) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(p.clone()) for p in params]
    optimizer = optimizer_class(params, lr=1e-2, weight_decay=0.1, **flags)
    for _ in range(5):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()
    return [param.detach() for param in params]


def initial(shapes) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator) for shape in shapes]


def test_fused_adam_equals_the_per_parameter_loop():
    for optimizer_class in (torch.optim.Adam, torch.optim.AdamW):
        start = initial(SHAPES)
        loop = trained(start, {"foreach": False}, optimizer_class)
        fused = trained(start, {"fused": True}, optimizer_class)
        for a, b in zip(loop, fused):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_fused_adam_is_the_same_for_a_split_of_the_parameters_at_multiples_of_16():
    whole = initial([(1003,)])[0]
    generator = torch.Generator().manual_seed(1)
    grads = [torch.randn(1003, generator=generator) for _ in range(5)]

    def run(cuts):
        params = [torch.nn.Parameter(piece.clone()) for piece in whole.split(cuts)]
        optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
        for grad in grads:
            for param, piece in zip(params, grad.split(cuts)):
                param.grad = piece.clone()
            optimizer.step()
        return torch.cat([p.detach() for p in params])

    assert torch.equal(run([1003]), run([16, 512, 475]))


def test_every_plain_group_of_a_chained_optimizer_steps_fused():
    plain = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
    plain.state[plain.param_groups[0]["params"][0]]["step"] = torch.tensor(2.0, dtype=torch.float64)
    other = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
    other.param_groups[0]["params"] = [SimpleNamespace()]  # stands for a DTensor: left to torch
    chained = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=plain), SimpleNamespace(optimizer=None)])
    chained.chained_optimizers.append(SimpleNamespace(optimizer=other))
    assert torch_optimizers(chained) == [plain, other]
    step_parameters_together(chained)
    assert (plain.param_groups[0]["fused"], plain.param_groups[0]["foreach"]) == (True, False)
    assert plain.state[plain.param_groups[0]["params"][0]]["step"].dtype == torch.float32
    assert other.param_groups[0]["foreach"] is None and other.param_groups[0]["fused"] is None


def test_a_group_without_a_fused_kernel_steps_multi_tensor():
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    step_parameters_together(SimpleNamespace(optimizer=sgd))
    assert (sgd.param_groups[0]["fused"], sgd.param_groups[0]["foreach"]) == (False, True)
