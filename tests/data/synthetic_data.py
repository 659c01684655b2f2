"""Mock settings shared by the data tests (a module, not conftest: conftest names collide across folders)."""

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
