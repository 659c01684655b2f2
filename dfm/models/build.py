"""Model factory: the config picks the architecture and the attention backend's layer spec."""

from __future__ import annotations

import importlib.util

import torch
from megatron.core import parallel_state

from dfm.models.common.init import init_params
from dfm.models.common.materialise import materialise_
from dfm.models.common.transformer_config import build_transformer_config
from dfm.models.common.varlen_attention import varlen_available
from dfm.models.dit.dit_model import DiTModel
from dfm.models.dit.dit_spec import dit_layer_spec, local_modules, te_modules
from dfm.models.flux.flux_model import FluxModel
from dfm.models.flux.flux_spec import flux_layer_specs
from dfm.models.wan.wan_model import WanModel
from dfm.models.wan.wan_spec import wan_layer_spec
from dfm.parallel.layout import ParallelLayout

ARCHITECTURES = ("dit_adaln", "dit_cross", "stdit", "moviegen", "flux", "wan")
# Families with their own model class and block: architecture -> (model class, spec of modules).
FAMILIES = {"flux": (FluxModel, flux_layer_specs), "wan": (WanModel, wan_layer_spec)}


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def resolve_attention_backend(requested: str, device: torch.device | str) -> str:
    """'auto' -> for a model on a CUDA ``device``: TE when it imports, else torch's varlen flash kernel
    (every dfm mask is a segment mask), else FlexAttention; on any other device: per-segment SDPA.

    The device the model runs on decides, not the host: a model converted or checked on the CPU of a
    GPU machine runs SDPA."""
    if requested != "auto":
        return requested
    if torch.device(device).type == "cuda":
        if transformer_engine_available():
            return "te"
        return "varlen" if varlen_available(device) else "flex"
    return "sdpa"


def layer_spec_for(model_cfg, layout: ParallelLayout, device: torch.device | str = "cpu"):
    if model_cfg.architecture not in ARCHITECTURES:
        raise NotImplementedError(f"model.architecture={model_cfg.architecture!r}; valid: {ARCHITECTURES}")
    backend = resolve_attention_backend(model_cfg.attention_backend, device)
    if backend == "te" and model_cfg.architecture == "stdit" and layout.cp > 1:
        # The all-to-all re-sharding wraps the local kernels; TE's CP splits per-sample segments only.
        raise NotImplementedError(
            f"stdit with {layout.key('cp')} > 1 runs on the local attention backends, not te: "
            "set model.attention_backend=flex or sdpa"
        )
    if backend == "te" and model_cfg.architecture == "flux":
        # FLUX's joint attention builds its own segments for the local kernels (joint_attention.py).
        if model_cfg.attention_backend == "te":
            raise NotImplementedError("flux runs on the local attention backends: set model.attention_backend=auto")
        backend = "varlen" if varlen_available(device) else "flex"
    modules = te_modules() if backend == "te" else local_modules(backend)
    if model_cfg.architecture in FAMILIES:
        return FAMILIES[model_cfg.architecture][1](modules)
    return dit_layer_spec(model_cfg.architecture, modules, model_cfg.qk_layernorm, model_cfg.num_moe_experts)


def build_model(
    model_cfg,
    precision: str,
    vp_stage: int | None = None,
    layout: ParallelLayout | None = None,
    device: torch.device | str = "cpu",
):
    """One (virtual) pipeline stage, parameters allocated on the CPU but not initialised (use under
    ``torch.device('meta')`` to count parameters without memory). ``layout`` None: the layout of
    ``model_cfg`` on the running world. ``device``: where the model will run; it picks the
    attention backend of ``auto`` (the caller moves the model there)."""
    layout = layout or ParallelLayout.from_config(model_cfg, torch.distributed.get_world_size())
    tconfig = build_transformer_config(model_cfg, layout, precision)
    pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    model_class = FAMILIES[model_cfg.architecture][0] if model_cfg.architecture in FAMILIES else DiTModel
    model = model_class(
        tconfig,
        layer_spec_for(model_cfg, layout, device),
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
    params_dtype_everywhere: bool = False,
):
    """One (virtual) pipeline stage of the model on ``device``, initialised layout-independently from
    ``seed``. Built on the meta device, then only this rank's parameters are allocated and drawn, a
    chunk at a time (dfm.models.common.init). ``params_dtype_everywhere``: see ``build_meta_chunk``."""
    model, tconfig = build_meta_chunk(model_cfg, precision, vp_stage, layout, params_dtype_everywhere, device)
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
):
    """One (virtual) pipeline stage on the meta device: shapes and attributes, no memory.
    ``params_dtype_everywhere``: the plain torch layers (embedders, final layer) in the precision's
    dtype too, as megatron's Float16Module casts them, not only megatron's layers. ``device``: where
    the parameters will live, which picks the attention backend (meta itself never does)."""
    with torch.device("meta"):
        model, tconfig = build_model(model_cfg, precision, vp_stage, layout, device)
    return (model.to(dtype=tconfig.params_dtype) if params_dtype_everywhere else model), tconfig
