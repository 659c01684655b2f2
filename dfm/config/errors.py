"""The one exception type the config system raises for user mistakes (defined in the leaf module
`dfm.errors`, so `dfm.parallel`'s layout rules raise it without importing the config package)."""

from dfm.errors import ConfigError

__all__ = ["ConfigError"]
