"""Packs balanced by cost: FLOPs even over DP ranks and micro-batches, every sample once, the token
limit held, the same packs whatever the layout, exact resume."""

from __future__ import annotations

import argparse

from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.balance import REALISTIC_MIX, global_packs, measure
from dfm.data.mock import MockDataSettings, MockPackedLoader, MockPacking, mock_sample_length
from dfm.data.pack_cost import PackCost
from dfm.data.pack_selection import cost_balanced_packs


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=1, max_value=600), min_size=1, max_size=120),
    capacity=st.integers(min_value=16, max_value=1024),
    linear=st.sampled_from([16.0, 256.0, 7 * 4096.0]),
)
def test_cost_packs_respect_capacity_and_keep_every_sample(lengths, capacity, linear):
    plan = cost_balanced_packs(lengths, capacity, PackCost(linear=linear))
    placed = [i for pack in plan.packs for i in pack]
    assert sorted(placed + plan.too_long) == list(range(len(lengths)))
    assert plan.too_long == [i for i, n in enumerate(lengths) if n > capacity]
    for pack in plan.packs:
        assert pack and sum(lengths[i] for i in pack) <= capacity


def test_cost_packs_are_even_where_token_packs_are_not():
    # Four 1024-token clips and 64 images of 64 tokens, 2048 tokens a pack, a 256-wide model.
    lengths = [1024] * 4 + [64] * 64
    cost = PackCost.for_width(256)
    packs = cost_balanced_packs(lengths, 2048, cost).packs
    costs = [cost.pack([lengths[i] for i in p]) for p in packs]
    assert max(costs) / min(costs) < 1.1
    assert any(lengths[i] == 1024 for i in packs[0]) and any(lengths[i] == 64 for i in packs[0])


def benchmark_args(**overrides) -> argparse.Namespace:
    values = dict(dp=8, micro_batches=4, seq_length=32768, window=256, samples=3072, hidden_size=4096)
    return argparse.Namespace(**{**values, **overrides})


def test_flops_per_dp_rank_within_5_percent_on_a_realistic_mix():
    args = benchmark_args()
    cost = PackCost.for_width(args.hidden_size)
    before = measure(global_packs("tokens", args, cost), args, cost)
    after = measure(global_packs("cost", args, cost), args, cost)
    assert after.per_rank <= 1.05 < before.per_rank
    assert after.per_micro_batch < before.per_micro_batch


def cost_loader(dp_rank: int, dp_size: int, segment_multiple: int = 1, total_multiple: int = 1):
    return MockPackedLoader(
        REALISTIC_MIX,
        dp_rank,
        dp_size,
        MockPacking(
            seq_length=32768,
            segment_multiple=segment_multiple,
            total_multiple=total_multiple,
            balance="cost",
            cost=PackCost.for_width(4096),
            window=64,
        ),
    )


def test_every_sample_is_used_once_within_the_token_limit():
    loader = cost_loader(0, 1)
    packs = [loader.next_pack_indices() for _ in range(60)]
    used = sorted(i for pack in packs for i in pack)
    assert len(used) == len(set(used))
    assert used[: len(used) - 64] == list(range(len(used) - 64))  # whole windows, in stream order
    assert all(sum(mock_sample_length(REALISTIC_MIX, i) for i in pack) <= 32768 for pack in packs)


def test_cost_packs_are_the_same_for_every_layout_and_dealt_round_robin():
    one_rank = cost_loader(0, 1)
    global_packs_ = [one_rank.next_pack_indices() for _ in range(24)]
    for rank in range(4):
        for segment, total in ((1, 1), (4, 8)):  # TP=1, and CP=2 with TP=2 + SP
            loader = cost_loader(rank, 4, segment, total)
            assert [loader.next_pack_indices() for _ in range(6)] == global_packs_[rank::4]


def test_mock_cost_loader_resumes_mid_window():
    mock = MockDataSettings(seed=3, text_embed_dim=8, in_channels=4)

    def make():
        return MockPackedLoader(
            mock, 1, 2, MockPacking(seq_length=1024, balance="cost", cost=PackCost.for_width(64), window=16)
        )

    reference = make()
    for _ in range(5):
        next(reference)
    state = reference.state_dict()
    expected = [next(reference).sample_index.tolist() for _ in range(8)]
    resumed = make()
    resumed.load_state_dict(state)
    assert [next(resumed).sample_index.tolist() for _ in range(8)] == expected
