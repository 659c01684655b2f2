"""Mock and energon settings shared by the data tests (a module, not conftest: conftest names collide across folders)."""

from dfm.data.energon.data_module import EnergonDataSettings
from dfm.data.energon.task_encoder import PackingSettings
from dfm.data.mock import MockDataSettings


def synthetic_settings(seed: int = 7) -> MockDataSettings:
    return MockDataSettings(
        seed=seed,
        image_sizes=[(8, 8), (8, 12), (12, 8)],
        video_sizes=[(3, 8, 8), (2, 8, 12)],
        text_len_range=(4, 24),
        in_channels=4,
        text_embed_dim=16,
    )


def small_settings(path, **overrides) -> EnergonDataSettings:
    """Energon loader settings for a small dataset at ``path``: 160-token packs, no worker processes."""
    values = dict(
        path=str(path),
        packing=PackingSettings(seq_length=160),
        packing_buffer_size=8,
        num_workers=0,
        shuffle_buffer_size=4,
        max_samples_per_sequence=4,
    )
    values.update(overrides)
    return EnergonDataSettings(**values)
