"""Diffusion formulations (EDM, flow matching), their samplers, and classifier-free guidance."""

from dfm.diffusion.edm import EDMPipeline, EDMSettings
from dfm.diffusion.flow import FlowPipeline, FlowSettings, shift_for_num_tokens
from dfm.diffusion.packed_loss import masked_mean_per_sample, per_token
from dfm.diffusion.pipeline import (
    DiffusionPipeline,
    SamplingOptions,
    apply_cfg_dropout,
    cfg_drop_mask,
    null_dropped_context,
)
from dfm.diffusion.registry import PIPELINE_NAMES, build_pipeline, pipeline_from_config

__all__ = [
    "PIPELINE_NAMES",
    "DiffusionPipeline",
    "EDMPipeline",
    "EDMSettings",
    "FlowPipeline",
    "FlowSettings",
    "SamplingOptions",
    "apply_cfg_dropout",
    "build_pipeline",
    "cfg_drop_mask",
    "masked_mean_per_sample",
    "null_dropped_context",
    "per_token",
    "pipeline_from_config",
    "shift_for_num_tokens",
]
