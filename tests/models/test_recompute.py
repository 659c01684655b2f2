"""Activation recomputation (full uniform / block, selective core attention): the same loss and
gradients as no recomputation, and fewer bytes saved for the backward pass."""

from __future__ import annotations

import pytest
import torch

from dfm.models.common.recompute import layer_runs
from tests.models._helpers import build_random_model, conditioning, make_samples, pack_samples, tiny_config

RECOMPUTE = {
    "full-uniform-1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full-uniform-2": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full-block-1": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective"),
}


def loss_grads_and_saved_bytes(cfg) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """One forward + backward of a randomly weighted model; bytes of tensors autograd saved."""
    model = build_random_model(cfg, seed=5)
    model.train()
    pack = pack_samples(make_samples(cfg), segment_multiple=8)
    c_noise, labels = conditioning(pack.num_samples)
    saved = 0

    def count(tensor):
        nonlocal saved
        saved += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(count, lambda tensor: tensor):
        loss = model(pack.latents, c_noise, pack, labels).square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, saved


@pytest.mark.parametrize("arch", ["dit_cross", "stdit", "moviegen_moe"])
@pytest.mark.parametrize("mode", list(RECOMPUTE))
def test_recompute_matches_and_saves_less(dist, arch, mode):
    base = dict(num_layers=4)
    ref_loss, ref_grads, ref_saved = loss_grads_and_saved_bytes(tiny_config(arch, **base))
    loss, grads, saved = loss_grads_and_saved_bytes(tiny_config(arch, **base, **RECOMPUTE[mode]))
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    assert sorted(grads) == sorted(ref_grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    assert saved < ref_saved, (mode, saved, ref_saved)


class _Config:
    def __init__(self, granularity, method, num_layers):
        self.recompute_granularity, self.recompute_method, self.recompute_num_layers = granularity, method, num_layers


def test_layer_runs_follow_megatron_methods():
    assert layer_runs(5, _Config("full", "uniform", 2), training=True) == [(0, 2, True), (2, 4, True), (4, 5, True)]
    assert layer_runs(3, _Config("full", "block", 2), training=True) == [(0, 1, True), (1, 2, True), (2, 3, False)]
    assert layer_runs(3, _Config("full", "block", 2), training=False) == [(0, 3, False)]
    assert layer_runs(3, _Config("selective", None, None), training=True) == [(0, 3, False)]
