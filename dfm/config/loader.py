"""Build a `ConfigContainer` from a recipe, a YAML file and Hydra-grammar overrides, in that order."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import re
import typing
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from dfm.config.container import ConfigContainer
from dfm.config.errors import ConfigError
from dfm.config.recipes import get_recipe
from dfm.config.typecheck import coerce_value
from dfm.config.validate import validate_config
from dfm.safe_files import write_text_no_follow

RECIPE_KEY = "recipe"


def build_config(
    recipe: str | None, config_file: str | None, overrides: Sequence[str] = (), world_size: int | None = None
) -> ConfigContainer:
    """Recipe -> YAML file -> dotted overrides, each layer overriding the one before.

    The base recipe is `recipe` if given, else the file's top-level `recipe:` key, else the
    ConfigContainer defaults. Unknown keys and wrong types raise ConfigError naming the key;
    so does a parallel layout that cannot run on ``world_size`` ranks (None: not checked).
    """
    file_values = load_yaml_file(config_file) if config_file else {}
    file_recipe = file_values.pop(RECIPE_KEY, None)
    if file_recipe is not None and not isinstance(file_recipe, str):
        raise ConfigError(f"config key '{RECIPE_KEY}' in config file '{config_file}' must be a recipe name")
    base = recipe or file_recipe
    cfg = get_recipe(base) if base else ConfigContainer()
    with _blame(f"config file '{config_file}'"):
        apply_mapping(cfg, file_values)
    apply_overrides(cfg, overrides)
    validate_config(cfg, world_size)
    return cfg


def apply_mapping(cfg: ConfigContainer, values: dict, prefix: str = "") -> None:
    """Set every (nested) key of `values` on `cfg`; `prefix` is where `values` sits in the tree."""
    node = _resolve_section(cfg, prefix, prefix) if prefix else cfg
    _set_fields(node, values, prefix)


def apply_overrides(cfg: ConfigContainer, overrides: Sequence[str]) -> None:
    """Apply `key=value` overrides, values parsed by Hydra's override grammar."""
    if not overrides:
        return
    # Imported here: Hydra's ANTLR parser takes ~0.15 s to import, only worth it with overrides.
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for text in overrides:
        key, value = _parse_override(parser, text)
        with _blame(f"override '{text}'"):
            set_key(cfg, key, value)


def set_key(cfg: ConfigContainer, key: str, value: Any) -> None:
    """Set the dotted `key` (a field or a whole section, given a mapping) to `value`."""
    section_key, _, name = key.rpartition(".")
    node = _resolve_section(cfg, section_key, key) if section_key else cfg
    _set_field(node, name, value, key)


def config_to_dict(cfg: ConfigContainer) -> dict:
    """Plain nested dict of the config (sections -> fields), safe to dump as YAML."""
    return dataclasses.asdict(cfg)


def format_config(cfg: ConfigContainer) -> str:
    """Human-readable YAML of the resolved config, for logs."""
    return yaml.dump(config_to_dict(cfg), Dumper=_ConfigDumper, sort_keys=False)


def save_config_yaml(cfg: ConfigContainer, path: str | Path) -> Path:
    """Write the resolved config; `build_config(None, path, [])` gives back an equal config."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = "# Resolved dfm config: every field, after recipe, file and overrides.\n"
    return write_text_no_follow(path, header + format_config(cfg))  # a link there is replaced, not written through


def explicit_keys(config_file: str | None, overrides: Sequence[str] = ()) -> frozenset[str]:
    """The dotted keys a run's config file and overrides set themselves (a recipe's values are not
    among them): what ``checkpoint.pretrained`` may not replace with the checkpoint's model section."""
    keys = set(_dotted_keys(load_yaml_file(config_file))) if config_file else set()
    keys.discard(RECIPE_KEY)
    keys.update(text.split("=", 1)[0] for text in overrides)
    return frozenset(keys)


def _dotted_keys(values: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        keys.extend(_dotted_keys(value, f"{dotted}.") if isinstance(value, dict) else [dotted])
    return keys


def load_yaml_file(path: str | Path) -> dict:
    """The top-level mapping of a YAML config file (empty file -> {})."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: '{path}'")
    try:
        data = yaml.load(path.read_text(), Loader=_Yaml12Loader)
    except (yaml.YAMLError, OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read config file '{path}': {error}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of sections, got {type(data).__name__}")
    return data


def valid_keys(cls: type = ConfigContainer, prefix: str = "") -> list[str]:
    """Every dotted key of a config dataclass, sections included: 'train', 'train.train_iters', ..."""
    keys = []
    for name, hint in typing.get_type_hints(cls).items():
        key = f"{prefix}.{name}" if prefix else name
        keys.append(key)
        if dataclasses.is_dataclass(hint):
            keys.extend(valid_keys(hint, key))
    return keys


def _set_fields(node: Any, values: Any, prefix: str) -> None:
    if values is None:  # `train:` with nothing under it in YAML
        return
    if not isinstance(values, dict):
        where = f"config key '{prefix}'" if prefix else "the config"
        raise ConfigError(f"{where} is a section and expects a mapping, got {type(values).__name__} {values!r}")
    for name, value in values.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        _set_field(node, str(name), value, key)


def _set_field(node: Any, name: str, value: Any, key: str) -> None:
    hints = typing.get_type_hints(type(node))
    if name not in hints:
        raise ConfigError(_unknown_key_message(key))
    hint = hints[name]
    if dataclasses.is_dataclass(hint):
        _set_fields(getattr(node, name), value, key)
    else:
        setattr(node, name, coerce_value(value, hint, key))


def _resolve_section(cfg: ConfigContainer, section_key: str, full_key: str) -> Any:
    node: Any = cfg
    walked = []
    for part in section_key.split("."):
        walked.append(part)
        hints = typing.get_type_hints(type(node))
        if part not in hints:
            raise ConfigError(_unknown_key_message(full_key, unknown_section=".".join(walked)))
        if not dataclasses.is_dataclass(hints[part]):
            raise ConfigError(f"config key '{'.'.join(walked)}' is a value, not a section; it has no sub-keys")
        node = getattr(node, part)
    return node


def _unknown_key_message(key: str, unknown_section: str | None = None) -> str:
    message = f"unknown config key '{key}'"
    if unknown_section is not None:
        message += f" (no section '{unknown_section}')"
    suggestion = _closest_key(key, valid_keys())
    return message + (f"; did you mean '{suggestion}'?" if suggestion else "")


def _closest_key(key: str, keys: list[str]) -> str | None:
    """Closest valid key: same field name in another section, else the most similar dotted key."""
    leaf = key.rpartition(".")[2]
    same_leaf = [k for k in keys if k.rpartition(".")[2] == leaf]
    if same_leaf:
        return same_leaf[0]
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    if close:
        return close[0]
    leaves = {k.rpartition(".")[2]: k for k in keys}
    close_leaf = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.75)
    return leaves[close_leaf[0]] if close_leaf else None


def _parse_override(parser: Any, text: str) -> tuple[str, Any]:
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import HydraException

    try:
        override = parser.parse_override(text)
    except HydraException as error:
        raise ConfigError(f"malformed override '{text}': expected key=value ({error})") from None
    if override.type is not OverrideType.CHANGE or override.package is not None:
        raise ConfigError(f"override '{text}': only plain 'key=value' is supported (no +, ++, ~ or @package)")
    if override.is_sweep_override():
        raise ConfigError(f"override '{text}': sweeps are not supported; quote or bracket values holding commas")
    return override.key_or_group, override.value()


@contextlib.contextmanager
def _blame(source: str) -> Iterator[None]:
    """Append where a ConfigError came from (a file, an override) to its message."""
    try:
        yield
    except ConfigError as error:
        raise ConfigError(f"{error} (in {source})") from None


class _Yaml12Loader(yaml.SafeLoader):
    """SafeLoader reading `1e-3` as a float (YAML 1.2), not as the string PyYAML's 1.1 rules give."""


_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
            |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
            |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
            |[-+]?\.(?:inf|Inf|INF)
            |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


class _ConfigDumper(yaml.SafeDumper):
    """Block-style YAML, except lists of scalars stay on one line: `[8, 16]`."""


def _represent_list(dumper: yaml.SafeDumper, items: list) -> yaml.Node:
    scalars_only = all(not isinstance(item, (list, dict)) for item in items)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", items, flow_style=scalars_only)


_ConfigDumper.add_representer(list, _represent_list)
