"""The initialisers modules declare give exactly the weights of DiT's name-based init rules
(adaLN-Zero, zero final layer and cross-attention output, N(0, std) timestep MLP and learned
position tables, xavier elsewhere), for every block family."""

from __future__ import annotations

import re

import pytest
import torch

from dfm.models.build import build_model_chunk
from dfm.models.common.init import name_seed
from tests.models._helpers import tiny_config

SEED, STD = 7, 0.02
NAME_ZERO = re.compile(r"(adaln\.linear\.|final_layer\.(adaln|linear)\.|cross_attention\.linear_proj\.)")


def by_name(name: str, shape: list[int]) -> torch.Tensor:
    """The initial value chosen from the parameter's global name alone."""
    generator = torch.Generator().manual_seed(name_seed(SEED, name))
    full = torch.empty(shape)
    if NAME_ZERO.search(name) or name.endswith("bias"):
        return full.zero_()
    if len(shape) == 1:
        return full.fill_(1.0)
    if "embed" in name and "tables" in name or name.startswith("t_embedder."):
        return full.normal_(0.0, STD, generator=generator)
    fan_out, fan_in = shape[0], int(torch.tensor(shape[1:]).prod())
    bound = (6.0 / (fan_in + fan_out)) ** 0.5
    return full.uniform_(-bound, bound, generator=generator)


@pytest.mark.parametrize(
    "family, extra",
    [
        ("dit_cross", dict(pos_embedding="learned3d")),
        ("dit_adaln", {}),
        ("stdit", {}),
        ("moviegen_moe", {}),
    ],
)
def test_declared_init_equals_name_rules(dist, family, extra):
    model, _ = build_model_chunk(tiny_config(family, init_method_std=STD, **extra), "fp32", SEED)
    declared = 0
    for name, param in model.named_parameters():
        assert torch.equal(param, by_name(model.global_param_name(name), list(param.shape))), name
        declared += hasattr(param, "dfm_init")
    assert declared > 0
