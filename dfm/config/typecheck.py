"""Check a parsed value (YAML or Hydra override) against a dataclass field's type hint."""

from __future__ import annotations

import types
import typing
from typing import Any, Literal, Union

from dfm.config.errors import ConfigError


def coerce_value(value: Any, hint: Any, key: str) -> Any:
    """Return `value` converted to `hint`, or raise ConfigError naming `key`.

    Deliberately strict: bools are not ints, floats are not ints. The only widenings are the
    harmless ones: int -> float, and int/float -> str (so `logger.wandb_exp_name=2024` works).
    """
    origin = typing.get_origin(hint)
    if origin is Union or origin is types.UnionType:
        return _coerce_union(value, typing.get_args(hint), key)
    if origin is Literal:
        return _coerce_literal(value, typing.get_args(hint), key)
    if origin is list:
        return _coerce_list(value, typing.get_args(hint), key)
    if hint is Any:
        return value
    if hint is bool:
        return _require(value, isinstance(value, bool), "bool", key)
    if hint is int:
        return _require(value, isinstance(value, int) and not isinstance(value, bool), "int", key)
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return float(_require(value, ok, "float", key))
    if hint is str:
        ok = isinstance(value, (str, int, float)) and not isinstance(value, bool)
        return str(_require(value, ok, "str", key))
    raise ConfigError(f"config key '{key}' has a type the loader does not support: {hint!r}")


def describe_type(hint: Any) -> str:
    """Readable name of a type hint, e.g. 'Optional[int]' or "one of 'edm', 'flow'"."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is Union or origin is types.UnionType:
        rest = [a for a in args if a is not type(None)]
        inner = " | ".join(describe_type(a) for a in rest)
        return f"{inner} or null" if len(rest) < len(args) else inner
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is list:
        return f"list[{describe_type(args[0])}]" if args else "list"
    return getattr(hint, "__name__", repr(hint))


def _coerce_union(value: Any, options: tuple, key: str) -> Any:
    if value is None and type(None) in options:
        return None
    for option in options:
        if option is type(None):
            continue
        try:
            return coerce_value(value, option, key)
        except ConfigError:
            continue
    raise _type_error(value, Union[options], key)  # noqa: UP007 (built from a runtime tuple)


def _coerce_literal(value: Any, choices: tuple, key: str) -> Any:
    # `type(...) is` keeps True from matching a Literal[1] choice.
    for choice in choices:
        if type(value) is type(choice) and value == choice:
            return value
    raise _type_error(value, Literal[choices], key)


def _coerce_list(value: Any, args: tuple, key: str) -> list:
    if not isinstance(value, (list, tuple)):
        raise _type_error(value, list[args[0]] if args else list, key)
    if not args:
        return list(value)
    return [coerce_value(item, args[0], f"{key}[{i}]") for i, item in enumerate(value)]


def _require(value: Any, ok: bool, expected: str, key: str) -> Any:
    if not ok:
        raise ConfigError(f"config key '{key}' expects {expected}, got {_describe_value(value)}")
    return value


def _type_error(value: Any, hint: Any, key: str) -> ConfigError:
    return ConfigError(f"config key '{key}' expects {describe_type(hint)}, got {_describe_value(value)}")


def _describe_value(value: Any) -> str:
    if value is None:
        return "null"
    return f"{type(value).__name__} {value!r}"
