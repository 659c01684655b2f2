"""Command-line front end: `--recipe`, `--config-file`, `--mock` and `key=value` overrides."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from dfm.config.container import ConfigContainer
from dfm.config.errors import ConfigError
from dfm.config.loader import build_config, explicit_keys
from dfm.config.recipes import recipe_names
from dfm.parallel.layout import launched_world_size

# A dotted key then '='; Hydra's grammar then parses the whole override (see loader.py).
_OVERRIDE_PATTERN = re.compile(r"^[A-Za-z_][\w.]*=")


@dataclass
class CliArgs:
    """What the command line asked for, before the config is built."""

    config_file: str | None = None
    mock: bool = False
    recipe: str | None = None
    overrides: list[str] = field(default_factory=list)

    def explicit_keys(self) -> frozenset[str]:
        """The dotted keys the config file and overrides set (not the recipe's)."""
        return explicit_keys(self.config_file, self.overrides)


def parse_args(argv: Sequence[str]) -> CliArgs:
    """Parse options; every other argument must be a `key=value` override."""
    namespace, rest = _build_parser().parse_known_args(list(argv))
    bad = [arg for arg in rest if not _OVERRIDE_PATTERN.match(arg)]
    if bad:
        raise ConfigError(
            f"unrecognized argument(s) {', '.join(repr(a) for a in bad)}: expected options "
            "--config-file/--recipe/--mock or config overrides like 'train.train_iters=100'"
        )
    return CliArgs(config_file=namespace.config_file, mock=namespace.mock, recipe=namespace.recipe, overrides=rest)


def load_config_from_cli(argv: Sequence[str]) -> tuple[ConfigContainer, CliArgs]:
    """Parse `argv` and build the config it describes, its layout checked against the ranks launched."""

    args = parse_args(argv)
    return build_config(args.recipe, args.config_file, args.overrides, launched_world_size()), args


def config_or_exit(argv: Sequence[str] | None = None) -> tuple[ConfigContainer, CliArgs]:
    """`load_config_from_cli`, but a ConfigError prints to stderr and exits with status 2.

    Entry scripts call this before any process group starts, so a typo costs no cluster time.
    """
    try:
        return load_config_from_cli(sys.argv[1:] if argv is None else argv)
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        sys.exit(2)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="dfm run. Extra arguments are config overrides in Hydra syntax, e.g. train.train_iters=100",
        allow_abbrev=False,  # `--conf` silently meaning `--config-file` hides typos
    )
    parser.add_argument("--config-file", default=None, help="YAML file overriding the recipe (may set `recipe:`)")
    parser.add_argument("--recipe", default=None, help=f"base recipe: {', '.join(recipe_names())}")
    parser.add_argument("--mock", action="store_true", help="train on generated mock data instead of dataset.path")
    return parser
