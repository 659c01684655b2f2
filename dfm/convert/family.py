"""What differs between published models: a ``Family`` per module (wan.py, flux.py, hunyuan.py) supplies
the config translation, the conversion rules (rules.py) and the parity check. Reading, writing and
checkpoints are shared (import_export.py, pretrained.py); the command line is cli.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import Tensor

from dfm.config.container import ConfigContainer, ModelConfig
from dfm.convert.rules import Rule


@dataclass(frozen=True)
class Family:
    """What differs between published models; see the module docstring."""

    architecture: str  # model.architecture value
    diffusers_class: str  # attribute of the diffusers package, e.g. "WanTransformer3DModel"
    model_overrides: Callable[[dict], dict]  # diffusers config.json -> {"model.<key>": value}
    diffusers_config: Callable[[ModelConfig], dict]  # the config.json an export writes
    rules: Callable[[ModelConfig], list[Rule]]
    # (diffusers folder, cfg, () -> the dfm weights as (name, tensor) pairs) -> max abs diff of dfm vs
    # diffusers on random packed inputs
    verify: Callable[[str, ConfigContainer, Callable[[], Iterable[tuple[str, Tensor]]]], float]
