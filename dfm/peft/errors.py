"""LoRA configuration and adapter-file errors."""

from dfm.errors import ConfigError


class PeftError(ConfigError):
    """A LoRA target, adapter file or checkpoint that does not fit; the message names it."""
