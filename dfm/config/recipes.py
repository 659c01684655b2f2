"""Named recipes: functions returning a complete `ConfigContainer`.

Adding a recipe: write a function returning a ConfigContainer, then add one line to `_RECIPES`.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable, Mapping
from types import MappingProxyType

from dfm.config.container import ConfigContainer, DatasetConfig, LoggerConfig, ModelConfig, OptimizerConfig, TrainConfig
from dfm.config.errors import ConfigError
from dfm.config.presets import PRESET_SETTINGS, PRESETS


def dit_recipe() -> ConfigContainer:
    """DiT-S-sized cross-attention DiT with every default."""
    return ConfigContainer()


def dit_tiny_recipe() -> ConfigContainer:
    """A DiT small enough for CPU smoke runs and tests (seconds per step)."""
    return ConfigContainer(
        model=ModelConfig(
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            in_channels=4,
            text_embed_dim=32,
            max_text_len=32,
        ),
        train=TrainConfig(train_iters=20),
        optimizer=OptimizerConfig(lr=1e-3),
        dataset=DatasetConfig(
            seq_length=256,
            mock_image_sizes=[[8, 8], [8, 16]],
            mock_video_sizes=[[2, 8, 8]],
            mock_text_len_range=[4, 16],
        ),
        logger=LoggerConfig(log_interval=1),
    )


def preset_recipe(name: str) -> ConfigContainer:
    """Every default, with the model of the published preset ``name`` (dfm/config/presets.py) and
    the preset's other settings."""
    cfg = ConfigContainer(model=ModelConfig(**PRESETS[name]))
    for section, values in PRESET_SETTINGS.get(name, {}).items():
        for key, value in values.items():
            setattr(getattr(cfg, section), key, value)
    return cfg


_RECIPES: Mapping[str, Callable[[], ConfigContainer]] = MappingProxyType(
    {
        "dit": dit_recipe,
        "dit_tiny": dit_tiny_recipe,
        **{name: functools.partial(preset_recipe, name) for name in PRESETS},
    }
)


def recipe_names() -> list[str]:
    """Sorted names `get_recipe` accepts."""
    return sorted(_RECIPES)


def get_recipe(name: str) -> ConfigContainer:
    """A fresh ConfigContainer from the recipe called `name`."""
    if name not in _RECIPES:
        raise ConfigError(_unknown_recipe_message(name))
    return _RECIPES[name]()


def _unknown_recipe_message(name: str) -> str:
    message = f"unknown recipe '{name}'"
    close = difflib.get_close_matches(name, list(_RECIPES), n=1)
    if close:
        message += f"; did you mean '{close[0]}'?"
    return message + f" (valid recipes: {', '.join(recipe_names())})"
