"""Initial values drawn a chunk of rows at a time, keeping only a rank's rows, equal bit for bit the
full tensor drawn in one call and sliced as megatron splits it (TP dim 0 or 1, stride 2, FSDP rows)."""

from __future__ import annotations

import math

import pytest
import torch

from dfm.config.loader import build_config
from dfm.models.build import build_model_chunk
from dfm.models.common import init
from dfm.models.common.init import InitialValue, TensorSplit, fill_initial, name_seed
from tests.training.entry import RECIPE_DIR

SEED, STD = 5, 0.02
RECIPES = RECIPE_DIR.parent


def drawn_whole(name: str, declared: str | None, shape: list[int], std: float = STD) -> torch.Tensor:
    """The values before chunked drawing: the full tensor in one call."""
    generator = torch.Generator().manual_seed(name_seed(SEED, name))
    full = torch.empty(shape)
    if declared == init.NORMAL:
        return full.normal_(0.0, std, generator=generator)
    bound = (6.0 / (shape[0] + math.prod(shape[1:]))) ** 0.5
    return full.uniform_(-bound, bound, generator=generator)


def sliced(full: torch.Tensor, split: TensorSplit | None) -> torch.Tensor:
    if split is None:
        return full
    chunks = torch.chunk(full, split.tp * split.stride, dim=split.dim)
    return torch.cat(chunks[split.rank :: split.tp], dim=split.dim)


SPLITS = [None, TensorSplit(0, 1, 2, 1), TensorSplit(0, 2, 2, 0), TensorSplit(1, 1, 4, 3), TensorSplit(1, 2, 2, 1)]


@pytest.mark.parametrize("declared", [None, init.NORMAL])
@pytest.mark.parametrize("shape", [[96, 20], [40, 12, 1, 2], [24, 8], [8, 36]])
@pytest.mark.parametrize("chunk_bytes", [1, 300, 1 << 20])
def test_chunked_rows_equal_the_whole_tensor_sliced(monkeypatch, declared, shape, chunk_bytes):
    monkeypatch.setattr(init, "CHUNK_BYTES", chunk_bytes)
    full = drawn_whole("blocks.0.w", declared, shape)
    for split in SPLITS:
        expected = sliced(full, split)
        local_rows = expected.shape[0]
        # All the rank's rows, and uneven FSDP row shards of them (rank 0 gets the extra rows).
        for rows in (range(local_rows), range(0, local_rows // 2 + 1), range(local_rows // 2 + 1, local_rows)):
            out = torch.full((len(rows), *expected.shape[1:]), float("nan"))
            fill_initial(out, InitialValue("blocks.0.w", declared, shape, SEED, STD), split, rows)
            assert torch.equal(out, expected[rows.start : rows.stop]), (split, rows)


def test_constants_need_no_generator():
    out = torch.empty(3, 4)
    fill_initial(out, InitialValue("blocks.0.linear.bias", None, [6, 4], SEED, STD), None, range(3))
    assert torch.equal(out, torch.zeros(3, 4))
    out = torch.empty(5)
    fill_initial(out, InitialValue("blocks.0.norm.weight", None, [10], SEED, STD), TensorSplit(0, 1, 2, 1), range(5))
    assert torch.equal(out, torch.ones(5))


@pytest.mark.parametrize("config", ["flux/conf/flux_tiny", "dit/conf/wan_tiny"])
@pytest.mark.parametrize("everywhere", [False, True])
def test_families_start_from_the_whole_tensors_drawn(dist, monkeypatch, config, everywhere):
    """FLUX and Wan (the DiT families: test_init_declarations.py) built on meta and drawn in chunks
    start from the full tensors drawn in one call, in bf16 rounded once from them."""
    cfg = build_config(None, str(RECIPES / f"{config}.yaml"), ["mixed_precision.precision=bf16"], world_size=1)
    monkeypatch.setattr(init, "CHUNK_BYTES", 4096)
    model, _ = build_model_chunk(cfg.model, "bf16", SEED, params_dtype_everywhere=everywhere)
    std = cfg.model.init_method_std
    for name, param in model.named_parameters():
        gname, declared = model.global_param_name(name), getattr(param, init.DECLARED_INIT, None)
        kind = init.initial_kind(gname, declared, list(param.shape))
        if isinstance(kind, str):
            expected = drawn_whole(gname, declared, list(param.shape), std)
        else:
            expected = torch.full(param.shape, kind)
        assert torch.equal(param, expected.to(param.dtype)), name
