"""Packed equals unpacked: a pack of samples with different (T, H, W) and text lengths gives the
same outputs and parameter gradients as running each sample alone, for every architecture and
local attention backend. Run in float64 so the tolerance can be tight: max error <= 1e-9 x the
tensor's max (only summation order differs). FlexAttention has no CPU backward: its gradients are
compared where CUDA exists, its outputs everywhere. The varlen backend runs its boundaries through a
reference kernel with flash's contract (tests/models/test_packed_attention.py) on every host: flash
kernels have no float64."""

import dataclasses

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from dfm.models.attention import BACKENDS
from dfm.models.attention import varlen as varlen_attention
from dfm.platform.device import compute_device
from tests.models._helpers import (
    ARCHITECTURES,
    build_random_model,
    conditioning,
    make_samples,
    pack_samples,
    tiny_config,
)
from tests.models.test_packed_attention import reference_varlen_attn

TOLERANCE = 1e-9  # max |packed - single| relative to max |single|, per tensor


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Relative to the tensor's own scale: gradients are long sums whose size varies per tensor."""
    error = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert error <= TOLERANCE * max(scale, 1e-6), f"{what}: max error {error:.3g} at scale {scale:.3g}"


def as_double(batch, device):
    return dataclasses.replace(batch, latents=batch.latents.double(), context=batch.context.double()).to(device)


def parameter_grads(model) -> dict[str, torch.Tensor]:
    grads = {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.fixture(autouse=True)
def no_moe_aux_loss_grad():
    # The load-balancing loss is a statistic of the whole pack, so its gradient legitimately
    # differs from per-sample runs; the model's own outputs and gradients must not.
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(0.0))
    yield
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))


@pytest.fixture(autouse=True)
def varlen_reference_kernel(monkeypatch):
    monkeypatch.setattr(varlen_attention, "torch_varlen_attn", reference_varlen_attn)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_packed_equals_unpacked(dist, name, backend):
    cfg = tiny_config(name, attention_backend=backend)
    device = compute_device()
    with_grads = backend != "flex" or device.type == "cuda"
    model = build_random_model(cfg).double().to(device)
    samples = make_samples(cfg)
    c_noise, labels = (t.to(device) for t in conditioning(len(samples)))
    pack = pack_samples(samples, segment_multiple=8)
    assert (torch.diff(pack.cu_seqlens_q_padded) > torch.diff(pack.cu_seqlens_q)).any()  # padded segments
    pack = as_double(pack, device)

    with torch.set_grad_enabled(with_grads):
        out = model(pack.latents, c_noise.double(), pack, labels)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype).to(device)
        if with_grads:
            (out * weights * pack.loss_mask[:, None]).sum().backward()
        packed_grads = parameter_grads(model)

        for i, sample in enumerate(samples):
            alone = as_double(pack_samples([sample]), device)
            start, length = int(pack.cu_seqlens_q_padded[i]), sample.seq_len_q
            single_out = model(alone.latents, c_noise[i : i + 1].double(), alone, labels[i : i + 1])
            assert_close_scaled(out[start : start + length], single_out, f"output of sample {i}")
            if with_grads:
                (single_out * weights[start : start + length]).sum().backward()  # grads accumulate over samples
        single_grads = parameter_grads(model)

    assert packed_grads.keys() == single_grads.keys()
    for param_name, grad in packed_grads.items():
        assert_close_scaled(grad, single_grads[param_name], f"grad of {param_name}")


def moe_grads_with_padding(segment_multiple: int) -> dict[str, torch.Tensor]:
    """Parameter grads (load-balancing loss included) of an MoE model on the test samples packed
    with segments padded to ``segment_multiple``; the loss reads real tokens only."""
    cfg = tiny_config("moviegen_moe")
    model = build_random_model(cfg, seed=4).double().train()
    pack = as_double(pack_samples(make_samples(cfg), segment_multiple=segment_multiple), "cpu")
    c_noise, labels = conditioning(pack.num_samples)
    out = model(pack.latents, c_noise.double(), pack, labels)
    (out.square().sum(dim=1) * pack.loss_mask).sum().backward()
    return parameter_grads(model)


def test_moe_load_balancing_loss_leaves_padding_out(dist, monkeypatch):
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    tight, padded = moe_grads_with_padding(1), moe_grads_with_padding(16)
    assert sorted(tight) == sorted(padded)
    for name, grad in tight.items():
        assert_close_scaled(padded[name], grad, name)

    # The same comparison with the mask dropped: padding tokens change the router's gradient.
    from dfm.models.dit.dit_layer import DiTLayer

    feed_forward = DiTLayer.feed_forward
    monkeypatch.setattr(
        DiTLayer,
        "feed_forward",
        lambda self, h, shift, scale, gate, padding_mask=None: feed_forward(self, h, shift, scale, gate),
    )
    unmasked = moe_grads_with_padding(16)
    router = [name for name in tight if "router" in name]
    assert router and any(not torch.allclose(unmasked[name], tight[name], rtol=1e-6) for name in router)
