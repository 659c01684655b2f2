"""``model.architecture`` -> its model family: the one place architecture names map to code.

A new family adds one line here (see docs/architecture.md, "Where to add a new model family")."""

from __future__ import annotations

from dfm.models.common.family import Family
from dfm.models.dit.family import DIT
from dfm.models.flux.family import FLUX
from dfm.models.hunyuan.family import HUNYUAN
from dfm.models.wan.family import WAN

FAMILIES: dict[str, Family] = {
    "dit_adaln": DIT,
    "dit_cross": DIT,
    "stdit": DIT,
    "moviegen": DIT,
    "flux": FLUX,
    "wan": WAN,
    "hunyuan_video15": HUNYUAN,
}
ARCHITECTURES = tuple(FAMILIES)


def family_of(model_cfg) -> Family:
    """The family of ``model_cfg.architecture``; NotImplementedError naming the valid ones."""
    family = FAMILIES.get(model_cfg.architecture)
    if family is None:
        raise NotImplementedError(f"model.architecture={model_cfg.architecture!r}; valid: {ARCHITECTURES}")
    return family
