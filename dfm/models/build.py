"""Model factory: the config picks the family (dfm/models/registry.py) and the attention backend
(chosen here, ``resolve_attention_backend``), whose modules the family's layer spec is built on."""

from __future__ import annotations

import importlib.util

import torch
from megatron.core import parallel_state

from dfm.config.container import HALF_PRECISIONS
from dfm.models.attention.modules import backend_modules
from dfm.models.attention.varlen import varlen_available
from dfm.models.common.fp8_linear import check_fp8_device
from dfm.models.common.init import init_params
from dfm.models.common.materialise import materialise_
from dfm.models.common.transformer_config import build_transformer_config
from dfm.models.registry import family_of
from dfm.parallel.layout import ParallelLayout


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def resolve_attention_backend(requested: str, device: torch.device | str, precision: str = "bf16") -> str:
    """'auto' -> for a model on a CUDA ``device``: TE when it imports, else torch's varlen flash kernel
    (every dfm mask is a segment mask) in bf16 / fp16, else FlexAttention (fp32 runs too); on any other
    device: per-segment SDPA. A training config asking for varlen in fp32 is refused by validate_config.

    The device the model runs on decides, not the host: a model converted or checked on the CPU of a
    GPU machine runs SDPA."""
    if requested != "auto":
        return requested
    if torch.device(device).type == "cuda":
        if transformer_engine_available():
            return "te"
        return "varlen" if varlen_usable(device, precision) else "flex"
    return "sdpa"


def varlen_usable(device: torch.device | str, precision: str) -> bool:
    return precision in HALF_PRECISIONS and varlen_available(device)


def layer_spec_for(model_cfg, layout: ParallelLayout, device: torch.device | str = "cpu", precision: str = "bf16"):
    """The family's layer spec on the attention backend ``model_cfg`` resolves to on ``device``."""
    family = family_of(model_cfg)
    backend = resolve_attention_backend(model_cfg.attention_backend, device, precision)
    backend = family.attention_backend(model_cfg, backend, layout, varlen_usable(device, precision))
    return family.layer_spec(model_cfg, backend_modules(backend))


def build_model(
    model_cfg,
    precision: str,
    vp_stage: int | None = None,
    layout: ParallelLayout | None = None,
    device: torch.device | str = "cpu",
    fp8: str | None = None,
):
    """One (virtual) pipeline stage, parameters allocated on the CPU but not initialised (use under
    ``torch.device('meta')`` to count parameters without memory). ``layout`` None: the layout of
    ``model_cfg`` on the running world. ``device``: where the model will run; it picks the
    attention backend of ``auto`` (the caller moves the model there). ``fp8``: ``mixed_precision.fp8``."""
    check_fp8_device(fp8, device)
    layout = layout or ParallelLayout.from_config(model_cfg, torch.distributed.get_world_size())
    family = family_of(model_cfg)
    tconfig = build_transformer_config(model_cfg, layout, precision, family.transformer_settings(model_cfg), fp8)
    pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    model = family.model(
        tconfig,
        layer_spec_for(model_cfg, layout, device, precision),
        model_cfg,
        pre_process=pre,
        post_process=post,
        vp_stage=vp_stage,
    )
    return model, tconfig


def build_model_chunk(
    model_cfg,
    precision: str,
    seed: int,
    vp_stage: int | None = None,
    layout: ParallelLayout | None = None,
    device: torch.device | str = "cpu",
    **meta_options,
):
    """One (virtual) pipeline stage of the model on ``device``, initialised layout-independently from
    ``seed``. Built on the meta device, then only this rank's parameters are allocated and drawn, a
    chunk at a time (dfm.models.common.init). ``meta_options``: ``build_meta_chunk``'s
    ``params_dtype_everywhere`` and ``fp8``."""
    model, tconfig = build_meta_chunk(model_cfg, precision, vp_stage, layout, device=device, **meta_options)
    materialise_(model, torch.device(device))
    init_params(model, seed, model.global_param_name, std=model_cfg.init_method_std)
    return model, tconfig


def build_meta_chunk(
    model_cfg,
    precision: str,
    vp_stage: int | None = None,
    layout: ParallelLayout | None = None,
    params_dtype_everywhere: bool = False,
    device: torch.device | str = "cpu",
    fp8: str | None = None,
):
    """One (virtual) pipeline stage on the meta device: shapes and attributes, no memory.
    ``params_dtype_everywhere``: the plain torch layers (embedders, final layer) in the precision's
    dtype too, as megatron's Float16Module casts them, not only megatron's layers. ``device``: where
    the parameters will live, which picks the attention backend (meta itself never does)."""
    with torch.device("meta"):
        model, tconfig = build_model(model_cfg, precision, vp_stage, layout, device, fp8)
    return (model.to(dtype=tconfig.params_dtype) if params_dtype_everywhere else model), tconfig
