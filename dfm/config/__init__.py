"""Typed run configuration: recipes, YAML files and Hydra-grammar CLI overrides."""

from dfm.config.cli import CliArgs, config_or_exit, load_config_from_cli, parse_args
from dfm.config.container import (
    CheckpointConfig,
    ConfigContainer,
    DatasetConfig,
    DDPConfig,
    LoggerConfig,
    MixedPrecisionConfig,
    ModelConfig,
    OptimizerConfig,
    RNGConfig,
    SchedulerConfig,
    TrainConfig,
)
from dfm.config.errors import ConfigError
from dfm.config.loader import build_config, config_to_dict, format_config, save_config_yaml
from dfm.config.recipes import get_recipe, recipe_names

__all__ = [
    "CheckpointConfig",
    "CliArgs",
    "ConfigContainer",
    "ConfigError",
    "DDPConfig",
    "DatasetConfig",
    "LoggerConfig",
    "MixedPrecisionConfig",
    "ModelConfig",
    "OptimizerConfig",
    "RNGConfig",
    "SchedulerConfig",
    "TrainConfig",
    "build_config",
    "config_or_exit",
    "config_to_dict",
    "format_config",
    "get_recipe",
    "load_config_from_cli",
    "parse_args",
    "recipe_names",
    "save_config_yaml",
]
