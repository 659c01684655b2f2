"""A teacher saved with another diffusion pipeline is refused when the distillation builds it: its outputs
would be read as velocities (docs/distillation.md, "The training run"). No process, no weights: a teacher
checkpoint folder holding only what the refusal reads (the saved config's model section)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dfm.checkpoint.errors import CheckpointError
from dfm.checkpoint.manifest import checkpoint_files, describe_files, write_manifest
from dfm.config.loader import build_config
from dfm.parallel import ParallelLayout
from dfm.training.distill_loop import frozen_teacher
from tests.training.entry import TINY

# What megatron's dist_checkpointing writes beside the tensors (metadata.json names the backends).
BACKENDS = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch"}


def teacher_folder(root: Path, pipeline: str) -> Path:
    """A checkpoint root whose one checkpoint's saved config says ``model.pipeline: <pipeline>``; no tensors."""
    directory = root / "iter_0000002"
    directory.mkdir(parents=True)
    (directory / "metadata.json").write_text(json.dumps({**BACKENDS, "common_backend_version": 1}))
    (directory / ".metadata").write_bytes(b"")
    torch.save({"config": {"model": {"pipeline": pipeline}}}, directory / "common.pt")
    write_manifest(directory, describe_files(directory, checkpoint_files(directory)))  # a complete save
    return root


def test_a_teacher_trained_with_another_pipeline_is_refused(tmp_path):
    """Deleting the pipeline comparison in ``frozen_teacher`` (dfm/training/distill_loop.py) makes this
    fail: the teacher is then built, which raises megatron's "parallel group is not initialized" here
    instead (checked by hand, 2026-11-29)."""
    teacher = teacher_folder(tmp_path / "teacher", "edm")
    cfg = build_config(
        None, str(TINY), ["model.pipeline=flow", "distill.enabled=true", f"checkpoint.pretrained={teacher}"]
    )
    layout = ParallelLayout.from_config(cfg.model, 1)
    with pytest.raises(CheckpointError, match=f"checkpoint.pretrained={teacher} was trained with model.pipeline=edm"):
        frozen_teacher(cfg, layout, torch.device("cpu"))
