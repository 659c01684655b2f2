"""Energon integration: cooker, task encoder with sequence packing, train/val loaders."""

from dfm.data.energon.cooker import CookedDiffusionSample, cook_diffusion_sample
from dfm.data.energon.data_module import (
    EnergonDataSettings,
    EnergonTrainLoader,
    build_train_loader,
    build_val_loader,
    write_blend_metadataset,
)
from dfm.data.energon.task_encoder import DiffusionTaskEncoder, PackingSettings, sample_metadata

__all__ = [
    "CookedDiffusionSample",
    "cook_diffusion_sample",
    "EnergonDataSettings",
    "EnergonTrainLoader",
    "build_train_loader",
    "build_val_loader",
    "write_blend_metadataset",
    "DiffusionTaskEncoder",
    "PackingSettings",
    "sample_metadata",
]
