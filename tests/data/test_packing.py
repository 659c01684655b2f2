"""Packing properties: never over the limit, never a split sample, every sample accounted for,
and >= 95 % of pack capacity holds real tokens on a mixed-size stream with the default buffer."""

from __future__ import annotations

import logging

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dfm.data.energon.data_module import EnergonDataSettings
from dfm.data.energon.pack_selection import first_fit_decreasing, packing_efficiency, segment_cost
from dfm.data.energon.task_encoder import DiffusionTaskEncoder, PackingSettings
from dfm.data.mock import MockDataSettings, mock_sample
from dfm.data.packing import round_up

logger = logging.getLogger(__name__)

DEFAULT_BUFFER = EnergonDataSettings.__dataclass_fields__["packing_buffer_size"].default

lengths_strategy = st.lists(st.integers(min_value=1, max_value=600), min_size=1, max_size=120)


@settings(max_examples=200, deadline=None)
@given(lengths=lengths_strategy, capacity=st.integers(min_value=16, max_value=1024),
       segment_multiple=st.sampled_from([1, 2, 4, 8]))
def test_first_fit_decreasing_respects_capacity_and_keeps_every_sample(lengths, capacity, segment_multiple):
    plan = first_fit_decreasing(lengths, capacity, segment_multiple)
    placed = [i for pack in plan.packs for i in pack]
    assert sorted(placed + plan.too_long) == list(range(len(lengths)))
    assert plan.too_long == [i for i, n in enumerate(lengths) if segment_cost(n, segment_multiple) > capacity]
    for pack in plan.packs:
        assert pack and sum(segment_cost(lengths[i], segment_multiple) for i in pack) <= capacity


mock_strategy = st.builds(
    MockDataSettings,
    seed=st.integers(0, 2**31),
    image_fraction=st.floats(0.0, 1.0),
    text_len_range=st.just((2, 40)),
    in_channels=st.just(4),
    text_embed_dim=st.just(8),
)


@settings(max_examples=25, deadline=None)
@given(mock=mock_strategy, cp=st.sampled_from([1, 2]), tp=st.sampled_from([1, 2]),
       seq_length=st.sampled_from([160, 256, 512]), first=st.integers(0, 10_000))
def test_packs_never_exceed_the_limit_nor_split_samples(mock, cp, tp, seq_length, first):
    packing = PackingSettings(seq_length=seq_length, segment_multiple=2 * cp if cp > 1 else 1, total_multiple=tp * cp)
    encoder = DiffusionTaskEncoder(packing)
    samples = [mock_sample(mock, first + i) for i in range(40)]
    packs = encoder.select_samples_to_pack(samples)
    too_long = [s for s in samples if round_up(s.seq_len_q, packing.segment_multiple) > seq_length]
    assert encoder.skipped_too_long == len(too_long)
    assert sum(len(p) for p in packs) + len(too_long) == len(samples)
    for pack in packs:
        batch = encoder.pack_selected_samples(pack)
        assert batch.seq_len <= seq_length and batch.seq_len % packing.total_multiple == 0
        offsets = batch.cu_seqlens_q_padded.tolist()
        for i, sample in enumerate(pack):
            start = offsets[i]
            # The whole sample sits contiguously in its own segment, in order.
            assert torch.equal(batch.latents[start : start + sample.seq_len_q], sample.tokens)
            assert (offsets[i + 1] - start) % packing.segment_multiple == 0 or i == len(pack) - 1
            assert int(batch.loss_mask[start : start + sample.seq_len_q].sum()) == sample.seq_len_q
        assert batch.num_real_tokens() == sum(s.seq_len_q for s in pack)


MIXED = dict(
    image_sizes=[(32, 32), (32, 48), (48, 32), (64, 64), (48, 64)],
    video_sizes=[(4, 32, 32), (8, 32, 48), (16, 32, 32), (4, 48, 64)],
    in_channels=1, text_embed_dim=4,  # token counts do not depend on channels; fewer keep the test fast
)


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**31), image_fraction=st.floats(0.2, 0.8), cp=st.sampled_from([1, 2]))
def test_packing_efficiency_on_mixed_sizes_with_default_buffer(seed, image_fraction, cp):
    seq_length = 8192
    mock = MockDataSettings(seed=seed, image_fraction=image_fraction, **MIXED)
    encoder = DiffusionTaskEncoder(PackingSettings(seq_length=seq_length, segment_multiple=2 * cp, total_multiple=cp))
    stream = [mock_sample(mock, i) for i in range(3 * DEFAULT_BUFFER)]
    batches = []
    for start in range(0, len(stream), DEFAULT_BUFFER):  # as energon's PackingDataset feeds buffers
        batches += [encoder.pack_selected_samples(p) for p in encoder.select_samples_to_pack(stream[start : start + DEFAULT_BUFFER])]
    efficiency = packing_efficiency(batches, seq_length)
    logger.warning("packing efficiency %.4f (seed %d, image fraction %.2f, cp %d)", efficiency, seed, image_fraction, cp)
    assert efficiency >= 0.95
