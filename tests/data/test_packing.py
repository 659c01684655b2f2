"""Packing properties: never more real tokens than seq_length, never a split sample, every sample
accounted for, the same packs whatever the layout's padding, and >= 92 % of pack capacity
(seq_length, real tokens) holds real tokens on random mixed-size streams with the default buffer."""

from __future__ import annotations

import logging

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from benchmarks.packing_draws import mixed_stream_efficiency
from dfm.data.energon.task_encoder import DiffusionTaskEncoder, PackingSettings
from dfm.data.mock import MockDataSettings, MockPackedLoader, MockPacking, mock_sample
from dfm.data.pack_selection import first_fit_decreasing
from dfm.data.packing import grouped_by_length

logger = logging.getLogger(__name__)

lengths_strategy = st.lists(st.integers(min_value=1, max_value=600), min_size=1, max_size=120)


@settings(max_examples=200, deadline=None)
@given(lengths=lengths_strategy, capacity=st.integers(min_value=16, max_value=1024))
def test_first_fit_decreasing_respects_capacity_and_keeps_every_sample(lengths, capacity):
    plan = first_fit_decreasing(lengths, capacity)
    placed = [i for pack in plan.packs for i in pack]
    assert sorted(placed + plan.too_long) == list(range(len(lengths)))
    assert plan.too_long == [i for i, n in enumerate(lengths) if n > capacity]
    for pack in plan.packs:
        assert pack and sum(lengths[i] for i in pack) <= capacity


mock_strategy = st.builds(
    MockDataSettings,
    seed=st.integers(0, 2**31),
    image_fraction=st.floats(0.0, 1.0),
    text_len_range=st.just((2, 40)),
    in_channels=st.just(4),
    text_embed_dim=st.just(8),
)


@settings(max_examples=25, deadline=None)
@given(
    mock=mock_strategy,
    cp=st.sampled_from([1, 2]),
    tp=st.sampled_from([1, 2]),
    seq_length=st.sampled_from([160, 256, 512]),
    first=st.integers(0, 10_000),
)
def test_packs_never_exceed_the_limit_nor_split_samples(mock, cp, tp, seq_length, first):
    packing = PackingSettings(seq_length=seq_length, segment_multiple=2 * cp if cp > 1 else 1, total_multiple=tp * cp)
    encoder = DiffusionTaskEncoder(packing)
    samples = [mock_sample(mock, first + i) for i in range(40)]
    packs = encoder.select_samples_to_pack(samples)
    too_long = [s for s in samples if s.seq_len_q > seq_length]
    assert encoder.skipped_too_long == len(too_long)
    assert sum(len(p) for p in packs) + len(too_long) == len(samples)
    for pack in packs:
        batch = encoder.pack_selected_samples(pack)
        # seq_length bounds the real tokens; the layout's padding comes on top.
        layout_padding = len(pack) * (packing.segment_multiple - 1) + packing.total_multiple - 1
        assert batch.num_real_tokens() <= seq_length and batch.seq_len <= seq_length + layout_padding
        assert batch.seq_len % packing.total_multiple == 0
        offsets = batch.cu_seqlens_q_padded.tolist()
        placed = grouped_by_length(pack)
        assert batch.sample_index.tolist() == [s.sample_index for s in placed]
        for i, sample in enumerate(placed):
            start = offsets[i]
            # The whole sample sits contiguously in its own segment, equal lengths side by side.
            assert torch.equal(batch.latents[start : start + sample.seq_len_q], sample.tokens)
            assert (offsets[i + 1] - start) % packing.segment_multiple == 0 or i == len(pack) - 1
            assert int(batch.loss_mask[start : start + sample.seq_len_q].sum()) == sample.seq_len_q
        assert batch.num_real_tokens() == sum(s.seq_len_q for s in pack)


# The bound, from the distribution of 500 seeded random draws (python -m benchmarks.packing_draws --seed 1
# --draws 300, and --seed 2 --draws 200 --max_image_fraction 0.3 for the mostly-video tail; 2026-11-25,
# 2-core CPU): min 0.9368, mostly-video streams (image fraction < 0.3) mean 0.971, sd 0.012. 0.92 lies
# 4 sd below that mean and 0.017 below the worst draw; both balances share it (their minima differ by 0.001).
MIN_EFFICIENCY = 0.92


# Random draws on every run (a failure prints its example and hypothesis replays it); the explicit
# example is the worst of the 500 measured draws.
@settings(max_examples=4, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    image_fraction=st.floats(0.2, 0.8),
    cp=st.sampled_from([1, 2]),
    balance=st.sampled_from(["cost", "tokens"]),
)
@example(seed=1892233001, image_fraction=0.2071996393943965, cp=2, balance="cost")
def test_packing_efficiency_on_mixed_sizes_with_default_buffer(seed, image_fraction, cp, balance):
    efficiency = mixed_stream_efficiency(seed, image_fraction, cp, balance)
    logger.warning(
        "packing efficiency %.4f (seed %d, image fraction %.2f, cp %d, %s)",
        efficiency,
        seed,
        image_fraction,
        cp,
        balance,
    )
    assert efficiency >= MIN_EFFICIENCY


# (segment_multiple, total_multiple) of dfm.training.data.padding_multiples for TP=1, TP=2+SP, CP=2.
LAYOUT_PADDINGS = {"tp1": (1, 1), "tp2_sp": (1, 2), "cp2": (4, 4)}
# Latent sizes whose token counts (patch 2) are not multiples of 16: 15, 35, 27, 45.
ODD_SIZES = dict(image_sizes=[(6, 10), (10, 14)], video_sizes=[(3, 6, 6), (5, 6, 6)], in_channels=4, text_embed_dim=8)


def test_energon_packs_do_not_depend_on_the_layout_padding():
    samples = [mock_sample(MockDataSettings(seed=5, **ODD_SIZES), i) for i in range(60)]
    assert any(s.seq_len_q % 16 for s in samples)
    grouping = {
        name: [
            [s.sample_index for s in pack]
            for pack in DiffusionTaskEncoder(
                PackingSettings(seq_length=96, segment_multiple=seg, total_multiple=tot)
            ).select_samples_to_pack(samples)
        ]
        for name, (seg, tot) in LAYOUT_PADDINGS.items()
    }
    assert grouping["tp1"] == grouping["tp2_sp"] == grouping["cp2"]
    assert len(grouping["tp1"]) > 5


def test_mock_packs_do_not_depend_on_the_layout_padding():
    settings = MockDataSettings(seed=5, **ODD_SIZES)
    grouping = {}
    for name, (seg, tot) in LAYOUT_PADDINGS.items():
        loader = MockPackedLoader(settings, 0, 1, MockPacking(seq_length=96, segment_multiple=seg, total_multiple=tot))
        grouping[name] = [next(loader).sample_index.tolist() for _ in range(20)]
    assert grouping["tp1"] == grouping["tp2_sp"] == grouping["cp2"]


def test_pack_offers_per_sample_lengths_on_device_and_host():
    from tests.models._helpers import make_samples, pack_samples, tiny_config

    samples = make_samples(tiny_config("dit_cross"))
    pack = pack_samples(samples, segment_multiple=8)
    video = [len(s.tokens) for s in samples]
    text = [len(s.text) for s in samples]
    assert pack.sample_lengths.tolist() == pack.host_sample_lengths() == video
    assert pack.text_lengths.tolist() == pack.host_text_lengths() == text
    assert pack.padded_sample_lengths.tolist() == [-(-n // 8) * 8 for n in video]
    assert int(pack.padded_text_lengths.sum()) == pack.context.shape[0]
    device_copy = pack.to("cpu")
    assert device_copy.host is pack and device_copy.host_sample_lengths() == video


def test_one_shape_packs_pad_captions_to_the_longest():
    """Every sample the same token count: each caption padded to the pack's longest (cross-attention
    reads the keys at one stride); mixed shapes: captions back to back."""
    import dataclasses

    from dfm.data.packing import pack_samples
    from tests.models._helpers import make_samples, tiny_config

    samples = make_samples(tiny_config("dit_cross"))
    one_shape = [dataclasses.replace(s, tokens=samples[0].tokens, pos_ids=samples[0].pos_ids) for s in samples]
    text = [len(s.text) for s in samples]
    assert len(set(text)) > 1
    pack = pack_samples(one_shape)
    assert pack.host_text_lengths() == text
    assert pack.padded_text_lengths.tolist() == [max(text)] * len(text)
    for start, sample in zip(pack.cu_seqlens_kv_padded[:-1].tolist(), one_shape):
        n = len(sample.text)
        assert torch.equal(pack.context[start : start + n], sample.text)
        assert not pack.context[start + n : start + max(text)].any()  # padding rows are zero
    assert len({len(s.tokens) for s in samples}) > 1
    assert pack_samples(samples).padded_text_lengths.tolist() == text


def test_a_pack_puts_equal_lengths_side_by_side_in_first_seen_order():
    samples = [mock_sample(MockDataSettings(seed=5, **ODD_SIZES), i) for i in range(24)]
    placed = grouped_by_length(samples)
    lengths = [s.seq_len_q for s in placed]
    firsts = list(dict.fromkeys(s.seq_len_q for s in samples))
    assert len(firsts) > 1
    # one run per length, the runs in order of each length's first sample, samples in order within a run
    assert [n for i, n in enumerate(lengths) if i == 0 or n != lengths[i - 1]] == firsts
    for n in firsts:
        assert [s.sample_index for s in placed if s.seq_len_q == n] == [
            s.sample_index for s in samples if s.seq_len_q == n
        ]
