"""The one exception type the config system raises for user mistakes."""


class ConfigError(ValueError):
    """A recipe, config file or override is invalid; the message names the key or file at fault."""
