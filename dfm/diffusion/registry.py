"""Diffusion pipelines by name (``model.pipeline``): the one table of formulations.

The base class (pipeline.py) knows none of them; each formulation (edm.py, flow.py) builds on it and is
listed here with its settings dataclass.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dfm.diffusion.edm import EDMPipeline, EDMSettings
from dfm.diffusion.flow import FlowPipeline, FlowSettings
from dfm.diffusion.pipeline import DiffusionPipeline
from dfm.diffusion.timestep_experts import expert_flow_settings

# name -> (pipeline class, its settings dataclass)
PIPELINES = {"edm": (EDMPipeline, EDMSettings), "flow": (FlowPipeline, FlowSettings)}
PIPELINE_NAMES = tuple(PIPELINES)


def build_pipeline(name: str, **settings: Any) -> DiffusionPipeline:
    """``build_pipeline("edm", sigma_data=1.0)`` or ``build_pipeline("flow", shift=3.0)``."""
    if name not in PIPELINES:
        raise ValueError(f"unknown diffusion pipeline {name!r}; valid: {', '.join(PIPELINE_NAMES)}")
    pipeline, settings_class = PIPELINES[name]
    return pipeline(settings_class(**settings))


def pipeline_from_config(cfg) -> DiffusionPipeline:
    """The pipeline ``cfg.model.pipeline`` names, with its section's settings (``cfg.edm`` / ``cfg.flow``)."""
    name = cfg.model.pipeline
    settings = dataclasses.asdict(getattr(cfg, name))
    if name == "flow":  # a Wan 2.2 expert's run draws its side of the boundary
        settings = expert_flow_settings(cfg.model, settings)
    return build_pipeline(name, **settings)
