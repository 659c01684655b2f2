"""What the diffusers-parity tests of the families share."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import Tensor

from dfm.convert.pretrained import fill_weights
from dfm.convert.rules import to_diffusers
from dfm.models.build import build_model


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
