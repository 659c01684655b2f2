"""A model with its parameters allocated but never initialised, for callers that load every weight next.

Built on the meta device (no memory, no random init), then given uninitialised storage on the target
device; generation and conversion fill it from a checkpoint or a diffusers folder, so the weights
exist once instead of a random model plus the loaded copy.
"""

from __future__ import annotations

import torch

from dfm.models.build import build_model


def empty_model(model_cfg, precision: str, device: torch.device | str = "cpu", cast: bool = False):
    """(model, TransformerConfig): ``build_model`` on meta (every parameter cast to the precision's dtype
    when ``cast``), then uninitialised storage on ``device``."""
    with torch.device("meta"):
        # The attention backend follows the device the weights will live on, not meta.
        model, tconfig = build_model(model_cfg, precision, device=device)
    if cast:
        model = model.to(dtype=tconfig.params_dtype)
    return model.to_empty(device=device), tconfig
