"""torch's multi-tensor Adam path, which dfm asks for on every device, updates exactly as the
per-parameter loop torch picks for CPU tensors by default."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dfm.platform.optimizer_steps import step_parameters_together, torch_optimizers

SHAPES = [(16, 8), (8,), (4, 4, 3), (1,)]


def trained(foreach: bool | None, optimizer_class=torch.optim.AdamW) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]
    optimizer = optimizer_class(params, lr=1e-2, weight_decay=0.1, foreach=foreach)
    for _ in range(5):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()
    return [param.detach() for param in params]


def test_multi_tensor_adam_equals_the_per_parameter_loop_bitwise():
    for optimizer_class in (torch.optim.Adam, torch.optim.AdamW):
        for loop, together in zip(trained(False, optimizer_class), trained(True, optimizer_class)):
            assert torch.equal(loop, together)


def test_every_plain_group_of_a_chained_optimizer_steps_together():
    plain = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
    other = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
    other.param_groups[0]["params"] = [SimpleNamespace()]  # stands for a DTensor: left to torch
    chained = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=plain), SimpleNamespace(optimizer=None)])
    chained.chained_optimizers.append(SimpleNamespace(optimizer=other))
    assert torch_optimizers(chained) == [plain, other]
    step_parameters_together(chained)
    assert plain.param_groups[0]["foreach"] is True
    assert other.param_groups[0]["foreach"] is None
