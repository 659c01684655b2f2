"""Errors every package may raise: a leaf module that imports nothing from dfm."""


class ConfigError(ValueError):
    """A recipe, config file or override is invalid; the message names the key or file at fault."""
