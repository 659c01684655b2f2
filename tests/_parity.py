"""What the diffusers-parity tests of the families share."""

from __future__ import annotations

from dfm.convert.pretrained import fill_weights
from dfm.models.build import build_model


def converted_model(cfg, weights: dict):
    """dfm's fp32 model of ``cfg.model`` holding ``weights`` ({global name: tensor}, the import's);
    call it inside ``single_process_world``."""
    model, _ = build_model(cfg.model, "fp32")
    fill_weights(model, weights, "the converted weights")
    return model
