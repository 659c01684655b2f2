"""What the diffusers-parity tests of the families share."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import Tensor

from dfm.convert.flux import per_sample_max_abs_diff
from dfm.convert.rules import to_diffusers
from dfm.convert.weights import fill_weights, single_process_world
from dfm.models.build import build_model


def random_model(build, seed: int = 0, std: float = 0.1, mean=None) -> torch.nn.Module:
    """``build()`` (a tiny diffusers model; torch seeded with ``seed`` first) in eval mode with every
    parameter redrawn N(mean(name, param), std^2) in name order from ``seed`` (``mean`` None: 0): zero
    or one inits would hide bugs."""
    torch.manual_seed(seed)
    model = build().eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            param.copy_(
                torch.randn(param.shape, generator=generator) * std + (0.0 if mean is None else mean(name, param))
            )
    return model


def converted_model(cfg, weights: dict, precision: str = "fp32"):
    """dfm's model of ``cfg.model`` (built for ``precision``, parameters fp32) holding ``weights``
    ({global name: tensor}, the import's); call it inside ``single_process_world``."""
    model, _ = build_model(cfg.model, precision)
    fill_weights(model, weights, "the converted weights")
    return model


def verified_diff(printed: str) -> float:
    """The max abs diff that ``convert_*.py import --verify`` printed (dfm vs diffusers)."""
    return float(re.search(r"max abs diff vs diffusers: (\S+)", printed).group(1))


def assert_bit_equal(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    """The same names, every tensor equal bit for bit."""
    assert sorted(actual) == sorted(expected)
    assert all(torch.equal(actual[name], tensor) for name, tensor in expected.items())


def assert_export_is_finetuned(exported: dict[str, Tensor], dump: Path, start: dict[str, Tensor], rules) -> None:
    """``exported`` (diffusers' names) is bit for bit the weights the TP=2 ranks gathered into ``dump``
    (independently of the checkpoint), fine-tuned from ``start``: 3 Adam steps of lr 1e-4 move a weight
    by <= ~3e-4, a shard loaded into the wrong place would differ by the weights' own size (~0.1)."""
    weights = torch.load(dump)
    assert_bit_equal(exported, to_diffusers(weights, rules))
    moved = max(float((weights[name] - start[name]).abs().max()) for name in start)
    assert 0 < moved < 1e-3


def dfm_pack_output(cfg, weights: dict, inputs: tuple) -> Tensor:
    """dfm's eval model of ``cfg`` holding ``weights`` (one process) on ``inputs``, without autograd -> [S, D]."""
    with single_process_world(cfg.rng.seed):
        model = converted_model(cfg, weights).eval()
        with torch.no_grad():
            return model(*inputs)


def assert_mixed_pack(batch) -> None:
    """The pack's samples differ in length and in text length (what packing could get wrong)."""
    assert len(set(batch.host_sample_lengths())) > 1 and len(set(batch.host_text_lengths())) > 1


def assert_pack_matches(packed: Tensor, references: list[Tensor], batch, tolerance: float) -> None:
    """Every sample's rows of ``packed`` within ``tolerance`` of its diffusers ``references`` (each a real
    signal, not zeros)."""
    assert min(float(r.abs().max()) for r in references) > 0.1
    assert max(per_sample_max_abs_diff(packed, references, batch)) <= tolerance


def dfm_pack_grads(cfg, weights: dict, inputs: tuple, upstream: Tensor) -> dict[str, Tensor]:
    """{global name: gradient} of sum(model(*inputs) * upstream), dfm's model of ``cfg`` holding ``weights``."""
    with single_process_world(cfg.rng.seed):
        model = converted_model(cfg, weights)
        (model(*inputs) * upstream).sum().backward()
        return {model.global_param_name(name): p.grad for name, p in model.named_parameters()}


def assert_grads_match(reference: torch.nn.Module, grads: dict[str, Tensor], rules, tolerance: float) -> None:
    """Each of diffusers' ``reference`` parameter gradients (None: zeros, reaching no output) within
    ``tolerance`` times max(1, its max) of dfm's ``grads`` mapped to diffusers' names by ``rules``."""
    mapped = to_diffusers(grads, rules)
    for name, param in reference.named_parameters():
        expected = torch.zeros_like(param) if param.grad is None else param.grad
        scale = max(1.0, float(expected.abs().max()))
        assert float((mapped[name] - expected).abs().max()) <= tolerance * scale, name
