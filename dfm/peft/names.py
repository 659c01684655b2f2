"""How adapter parameters are named: ``<linear>.lora.A.<part>`` and ``<linear>.lora.B.<part>``."""

ADAPTER = "lora"  # the adapter's attribute on its linear


def is_adapter_param(name: str) -> bool:
    """A LoRA adapter's parameter (or state-dict key), by name."""
    return f".{ADAPTER}." in f".{name}"
