"""The lean FLUX blocks' pieces against the plain ops: qk_norm_rope without tables (the text stream) and
with fp32 tables on bf16 heads (diffusers' RoPE numerics), and the tiny model with
``model.recompute_activation`` (the single-stream blocks' activation) on and off. ``through_rebuilt``
(the projections keeping their sources): tests/models/test_rebuilt.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.embeddings import apply_rotary_emb

from dfm.convert.flux import verification_pack
from dfm.convert.weights import single_process_world
from dfm.models.attention.qk_norm_rope import qk_norm_rope
from dfm.models.flux.rope import rope_cos_sin
from tests._parity import converted_model
from tests.flux._tiny import dfm_config_and_weights, tiny_diffusers_flux
from tests.models.test_lean_block import assert_same_grads, rand


def test_qk_norm_rope_without_tables_is_the_weighted_rms_norm():
    def reference(x, weight, cos, sin, eps, interleaved):
        return F.rms_norm(x, (8,), weight, eps)

    assert_same_grads(qk_norm_rope, reference, (rand(5, 1, 3, 8), rand(8, seed=1), None, None, 1e-6, True))


def test_qk_norm_rope_with_fp32_tables_rotates_bf16_heads_as_diffusers():
    """bf16 heads, FLUX's fp32 cos / sin: the product in fp32 rounded once to bf16, as diffusers'
    ``apply_rotary_emb`` on F.rms_norm's output; the gradients those of that composition."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(40, 1, 3, 16, generator=generator).bfloat16().requires_grad_()
    weight = (torch.randn(16, generator=generator) * 0.3 + 1).bfloat16().requires_grad_()
    cos, sin = rope_cos_sin(torch.randint(0, 30, (40, 3), generator=generator), [4, 6, 6])

    def reference(x, weight):
        heads_first = F.rms_norm(x, (16,), weight, 1e-6).permute(1, 2, 0, 3)
        rotated = apply_rotary_emb(heads_first, (cos[:, 0, 0], sin[:, 0, 0]), use_real=True, use_real_unbind_dim=-1)
        return rotated.permute(2, 0, 1, 3)

    out, expected = qk_norm_rope(x, weight, cos, sin, 1e-6, True), reference(x, weight)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    grad = torch.randn(out.shape, generator=generator).bfloat16()
    for got, want in zip(torch.autograd.grad(out, (x, weight), grad), torch.autograd.grad(expected, (x, weight), grad)):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("full_recompute", [False, True], ids=["plain", "full_recompute"])
def test_recompute_activation_gives_the_same_gradients(full_recompute):
    """Both block kinds (2 double-, 2 single-stream): outputs bit-equal, gradients equal."""
    cfg, weights = dfm_config_and_weights(tiny_diffusers_flux())
    batch, t, guidance = verification_pack(cfg.model)
    extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    results = []
    for recompute in (False, True):
        model_cfg = dataclasses.replace(cfg.model, recompute_activation=recompute, **(extra if full_recompute else {}))
        with single_process_world(cfg.rng.seed):
            model = converted_model(dataclasses.replace(cfg, model=model_cfg), weights)
            out = model(batch.latents, t, batch, guidance)
            out.square().sum().backward()
            results.append((out.detach(), {name: p.grad for name, p in model.named_parameters()}))
    (base_out, base_grads), (out, grads) = results
    assert torch.equal(out, base_out)
    for name, grad in base_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)
