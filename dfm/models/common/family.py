"""What a model family supplies to the shared scaffold; dfm/models/registry.py maps
``model.architecture`` names to these."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dfm.parallel.layout import ParallelLayout


def no_settings(model_cfg) -> dict[str, Any]:
    return {}


def any_backend(model_cfg, backend: str, layout: ParallelLayout, varlen_ok: bool) -> str:
    return backend


@dataclass(frozen=True)
class Family:
    """One family's code: ``model`` (a PackedDiffusionModel subclass, built with ``layer_spec(model_cfg,
    BackendModules)``), its FLOPs count and what it changes in the shared config and backend choice."""

    model: Callable[..., Any]  # the class, or a function building it (Wan: one model or both experts)
    # (model_cfg, BackendModules) -> what ``model`` takes as its layer_spec (one ModuleSpec or several).
    layer_spec: Callable[..., Any]
    # (model_cfg, video_lens, text_lens, frames | None) -> forward FLOPs of one pack (2 per multiply-add).
    forward_flops: Callable[[Any, Sequence[int], Sequence[int], Sequence[int] | None], float]
    # model_cfg -> TransformerConfig fields this family sets otherwise (dfm/models/common/transformer_config.py).
    transformer_settings: Callable[[Any], dict[str, Any]] = no_settings
    # (model_cfg, resolved backend, layout, varlen_ok) -> the backend it runs on; raises when none fits.
    attention_backend: Callable[[Any, str, ParallelLayout, bool], str] = any_backend
