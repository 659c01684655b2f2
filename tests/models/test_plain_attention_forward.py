"""Attention modules' plain calls (lean_forward.py) against megatron's ``Attention.forward``: the same
output and gradients, bit for bit, for every self- and cross-attention of a packed DiT step; a call
asking for more than the plain path (here: megatron's own RoPE) goes to megatron's forward."""

import pytest
import torch
from megatron.core.transformer.attention import Attention

from dfm.data.packing import pack_samples
from dfm.diffusion.registry import build_pipeline
from dfm.models.attention.lean_forward import PlainAttentionForward
from dfm.training.forward_step import DiffusionForwardStep
from tests.models._helpers import build_random_model, make_samples, tiny_config


def step_outputs(cfg, monkeypatch, megatrons: bool):
    """Loss and parameter gradients of one packed step, attention through megatron's forward or not;
    and how many calls entered megatron's forward."""
    calls = []
    original = Attention.forward
    monkeypatch.setattr(Attention, "forward", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    if megatrons:
        monkeypatch.setattr(PlainAttentionForward, "is_plain", lambda self: False)
    model = build_random_model(cfg)
    step = DiffusionForwardStep(build_pipeline("flow"), seed=1, cfg_dropout_prob=0.0, device=torch.device("cpu"))
    batch, noise, level = step.prepare(pack_samples(make_samples(cfg), segment_multiple=8))
    output, loss_fn = step.run(model, batch, noise, level)
    loss = loss_fn(output)[0]
    loss.backward()
    monkeypatch.undo()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, len(calls)


@pytest.mark.parametrize("arch", ["dit_cross", "dit_cross_nemo", "stdit", "moviegen"])
def test_plain_calls_equal_megatrons_forward(dist, monkeypatch, arch):
    cfg = tiny_config(arch, attention_backend="sdpa")
    plain_loss, plain_grads, plain_calls = step_outputs(cfg, monkeypatch, megatrons=False)
    loss, grads, calls = step_outputs(cfg, monkeypatch, megatrons=True)
    assert plain_calls == 0 and calls >= cfg.num_layers
    assert torch.equal(plain_loss, loss)
    assert plain_grads.keys() == grads.keys() and plain_grads
    assert all(torch.equal(plain_grads[name], grads[name]) for name in grads)


def test_a_call_with_megatrons_rope_goes_to_megatrons_forward(dist, monkeypatch):
    calls = []
    original = Attention.forward
    monkeypatch.setattr(Attention, "forward", lambda self, *a, **k: calls.append(k) or original(self, *a, **k))
    model = build_random_model(tiny_config("dit_cross", attention_backend="sdpa"))
    cross = model.layers[0].cross_attention
    hidden, context = torch.randn(6, 1, 48), torch.randn(5, 1, 48)
    cross(hidden, attention_mask=None, key_value_states=context)
    assert calls == []  # plain: megatron's forward not entered
    angles = torch.zeros(6, 1, 1, 12)
    with pytest.raises(Exception):  # noqa: B017 - megatron's own RoPE path on a cross-attention: its error, not ours
        cross(hidden, attention_mask=None, key_value_states=context, rotary_pos_emb=angles)
    assert len(calls) == 1 and calls[0]["rotary_pos_emb"] is angles
