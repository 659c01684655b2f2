"""The shared conversion rules and diffusers folders: layouts megatron reads, exact round trips, named errors."""

from __future__ import annotations

import pytest
import torch

from dfm.convert.diffusers_folder import INDEX, read_diffusers_folder, write_diffusers_folder
from dfm.convert.rules import ConversionError, concat, fused_kv, fused_qkv, rename, to_dfm, to_diffusers

HN, H = 3, 5  # head dim, hidden (input) size


def megatron_qkv_split(fused: torch.Tensor, num_heads: int, groups: int) -> tuple[torch.Tensor, ...]:
    """What megatron's SelfAttention does with linear_qkv's output rows: per group [q heads, k, v]."""
    per_group = fused.reshape(groups, (num_heads // groups + 2) * HN, -1)
    q, k, v = torch.split(per_group, [num_heads // groups * HN, HN, HN], dim=1)
    return q.reshape(num_heads * HN, -1), k.reshape(groups * HN, -1), v.reshape(groups * HN, -1)


@pytest.mark.parametrize("num_heads,groups", [(4, 4), (4, 2), (6, 1)])
def test_fused_qkv_is_the_layout_megatron_splits(num_heads, groups):
    q, k, v = torch.randn(num_heads * HN, H), torch.randn(groups * HN, H), torch.randn(groups * HN, H)
    rule = fused_qkv("qkv", "q", "k", "v", num_heads, groups)
    fused = to_dfm({"q": q, "k": k, "v": v}, [rule])["qkv"]
    for got, want in zip(megatron_qkv_split(fused, num_heads, groups), (q, k, v)):
        assert torch.equal(got, want)
    back = to_diffusers({"qkv": fused}, [rule])
    assert all(torch.equal(back[n], t) for n, t in (("q", q), ("k", k), ("v", v)))


def test_fused_kv_is_per_head_k_then_v():
    heads = 4
    k, v = torch.randn(heads * HN), torch.randn(heads * HN)  # biases
    fused = to_dfm({"k": k, "v": v}, [fused_kv("kv", "k", "v", heads)])["kv"].reshape(heads, 2, HN)
    assert torch.equal(fused[:, 0].reshape(-1), k) and torch.equal(fused[:, 1].reshape(-1), v)


def test_round_trip_is_bit_exact_and_keeps_dtype():
    state = {"a": torch.randn(4, 2, dtype=torch.bfloat16), "b1": torch.randn(2, 3), "b2": torch.randn(5, 3)}
    rules = [rename("x", "a"), concat("y", ["b1", "b2"], [2, 5])]
    back = to_diffusers(to_dfm(state, rules), rules)
    assert sorted(back) == sorted(state)
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor)


def test_missing_and_unused_keys_are_named():
    rules = [rename("x", "a"), rename("y", "b")]
    with pytest.raises(ConversionError, match=r"missing 1 key\(s\): b.*no rule reads: extra"):
        to_dfm({"a": torch.zeros(1), "extra": torch.zeros(1)}, rules, source="folder X")


@pytest.mark.parametrize("max_shard_bytes", [2**30, 64])
def test_diffusers_folder_round_trip(tmp_path, max_shard_bytes):
    state = {f"w{i}": torch.randn(4, 4) for i in range(3)}
    state["view"] = torch.randn(8, 4)[2:6]  # a view of a larger tensor, as a split gives
    write_diffusers_folder(tmp_path / "transformer", {"num_layers": 2}, state, max_shard_bytes=max_shard_bytes)
    assert (tmp_path / "transformer" / INDEX).exists() == (max_shard_bytes == 64)
    config, back = read_diffusers_folder(tmp_path)  # a pipeline folder: finds transformer/
    assert config == {"num_layers": 2}
    assert sorted(back) == sorted(state) and all(torch.equal(back[n], t) for n, t in state.items())


def test_not_a_diffusers_folder_is_named(tmp_path):
    with pytest.raises(ConversionError, match=str(tmp_path)):
        read_diffusers_folder(tmp_path)
