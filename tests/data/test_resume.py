"""A loader restored from its saved state yields exactly what an uninterrupted loader yields next."""

from __future__ import annotations

import io
import pickle

import pytest
import torch

from dfm.data.energon.data_module import EnergonDataSettings, build_train_loader
from dfm.data.energon.task_encoder import PackingSettings, sample_metadata
from dfm.data.mock import MockDataSettings, MockPackedLoader, MockPacking


def pack_signature(batch) -> tuple:
    return (
        tuple(batch.sample_index.tolist()),
        tuple(m["key"] for m in sample_metadata(batch)),
        float(batch.latents.double().sum()),
        float(batch.context.double().sum()),
    )


def energon_settings(path, num_workers: int) -> EnergonDataSettings:
    return EnergonDataSettings(
        path=str(path),
        packing=PackingSettings(seq_length=160, segment_multiple=2, total_multiple=2),
        packing_buffer_size=12,
        num_workers=num_workers,
        shuffle_buffer_size=8,
        max_samples_per_sequence=4,
    )


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])  # 2: worker processes
def test_energon_loader_resumes_exactly(synthetic_dataset, num_workers):
    settings = energon_settings(synthetic_dataset, num_workers)
    consumed, following = 7, 6
    reference = build_train_loader(settings, dp_rank=0, dp_size=1)
    for _ in range(consumed):
        next(reference)
    # Through pickle, as a checkpoint would store it.
    state = pickle.loads(pickle.dumps(reference.state_dict()))
    expected = [pack_signature(next(reference)) for _ in range(following)]

    resumed = build_train_loader(settings, dp_rank=0, dp_size=1)
    resumed.load_state_dict(state)
    assert [pack_signature(next(resumed)) for _ in range(following)] == expected


def test_energon_state_is_checked_against_the_dp_layout(synthetic_dataset):
    settings = energon_settings(synthetic_dataset, 0)
    state = build_train_loader(settings, dp_rank=0, dp_size=2).state_dict()
    with pytest.raises(ValueError, match="dp_rank"):
        build_train_loader(settings, dp_rank=1, dp_size=2).load_state_dict(state)


@pytest.mark.parametrize("samples_per_pack", [None, 3])
def test_mock_loader_resumes_exactly(samples_per_pack):
    mock = MockDataSettings(seed=3, text_embed_dim=8, in_channels=4)

    def make():
        return MockPackedLoader(
            mock,
            dp_rank=1,
            dp_size=3,
            packing=MockPacking(
                seq_length=1024, segment_multiple=4, total_multiple=8, samples_per_pack=samples_per_pack
            ),
        )

    reference = make()
    for _ in range(5):
        next(reference)
    state = torch.load(_roundtrip(reference.state_dict()), weights_only=True)
    expected = [pack_signature(next(reference)) for _ in range(4)]
    resumed = make()
    resumed.load_state_dict(state)
    assert [pack_signature(next(resumed)) for _ in range(4)] == expected


def _roundtrip(obj) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer
