"""Training data for the loop: mock packs or an Energon dataset, sharded by data-parallel rank only."""

from __future__ import annotations

import dataclasses

from megatron.core import parallel_state

from dfm.config.container import ConfigContainer
from dfm.data.mock import MockDataSettings, MockPackedLoader, MockPacking
from dfm.data.pack_cost import PackCost
from dfm.data.pack_draws import DrawSettings
from dfm.diffusion.registry import pipeline_from_config
from dfm.parallel.layout import ParallelLayout
from dfm.platform import compat


def data_parallel_info() -> tuple[int, int]:
    return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()


def pack_cost(cfg: ConfigContainer) -> PackCost:
    return PackCost.for_width(cfg.model.hidden_size, cfg.model.effective_ffn_hidden_size)


def draw_settings(cfg: ConfigContainer) -> DrawSettings:
    """What the loaders draw for each pack's samples: what the training step reads (``rng.seed``, the
    pipeline's level numbers)."""
    return DrawSettings(cfg.rng.seed, pipeline_from_config(cfg).level_draw_kinds())


def build_mock_loader(cfg: ConfigContainer, layout: ParallelLayout) -> MockPackedLoader:
    d, m = cfg.dataset, cfg.model
    settings = MockDataSettings(
        seed=cfg.rng.seed,
        image_sizes=[tuple(s) for s in d.mock_image_sizes],
        video_sizes=[tuple(s) for s in d.mock_video_sizes],
        image_fraction=d.mock_image_fraction,
        text_len_range=tuple(d.mock_text_len_range),
        in_channels=m.in_channels,
        text_embed_dim=m.text_embed_dim,
        patch_temporal=m.patch_temporal,
        patch_spatial=m.patch_spatial,
        pooled_text_dim=m.pooled_text_dim,
    )
    dp_rank, dp_size = data_parallel_info()
    segment, total = layout.padding_multiples()
    packing = MockPacking(
        d.seq_length,
        segment,
        total,
        samples_per_pack=d.mock_samples_per_pack,
        balance=d.packing_balance,
        cost=pack_cost(cfg),
        window=d.packing_buffer_size or 1,
        draws=draw_settings(cfg),
    )
    return MockPackedLoader(settings, dp_rank, dp_size, packing)


def energon_settings(cfg: ConfigContainer, layout: ParallelLayout):
    from dfm.data.energon.data_module import EnergonDataSettings
    from dfm.data.energon.task_encoder import PackingSettings

    d, m = cfg.dataset, cfg.model
    if not d.path:
        raise ValueError("dataset.path is not set: point it at an energon dataset, or run with --mock")
    segment, total = layout.padding_multiples()
    packing = PackingSettings(
        seq_length=d.seq_length,
        patch_temporal=m.patch_temporal,
        patch_spatial=m.patch_spatial,
        max_text_len=m.max_text_len,
        segment_multiple=segment,
        total_multiple=total,
        balance=d.packing_balance,
        cost=pack_cost(cfg),
        in_channels=m.in_channels,
        text_embed_dim=m.text_embed_dim,
        pooled_text_dim=m.pooled_text_dim,
        image_conditions=m.architecture == "hunyuan_video15",
        draws=draw_settings(cfg),
    )
    return EnergonDataSettings(
        path=d.path,
        packing=packing,
        packing_buffer_size=d.packing_buffer_size or 1,
        num_workers=d.num_workers,
        shuffle_buffer_size=d.shuffle_buffer_size,
        max_samples_per_sequence=d.max_samples_per_sequence,
        seed=cfg.rng.seed,
        val_limit=cfg.train.eval_iters,
        skip_bad_samples=d.skip_bad_samples,
        allow_pickle=d.allow_pickle,
        allow_code=d.allow_code,
        cooked_cache_mib=d.cooked_cache_mib,
    )


def build_train_loader(cfg: ConfigContainer, layout: ParallelLayout, mock: bool):
    if mock:
        return build_mock_loader(cfg, layout)
    from dfm.data.energon.data_module import build_train_loader as energon_train_loader

    compat.install_loader_patches()
    return energon_train_loader(energon_settings(cfg, layout), *data_parallel_info())


# Mock validation samples come from their own seed, so they never overlap the training stream.
MOCK_VALIDATION_SEED_OFFSET = 1_000_003


def build_val_iterator(cfg: ConfigContainer, layout: ParallelLayout, mock: bool):
    """A fresh iterator over the validation packs: the same packs at every evaluation."""
    if mock:
        loader = build_mock_loader(cfg, layout)
        loader.settings = dataclasses.replace(loader.settings, seed=cfg.rng.seed + MOCK_VALIDATION_SEED_OFFSET)
        return loader
    from dfm.data.energon.data_module import build_val_loader

    compat.install_loader_patches()
    return iter(build_val_loader(energon_settings(cfg, layout), *data_parallel_info()))
