"""Model factory: the config picks the architecture and the attention backend's layer spec."""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core import parallel_state

from dfm.models.common.init import init_params
from dfm.models.common.transformer_config import build_transformer_config
from dfm.models.dit.dit_model import DiTModel
from dfm.models.dit.dit_spec import dit_layer_local_spec


def resolve_attention_backend(requested: str) -> str:
    """'auto' -> TE when it imports on a GPU, else FlexAttention on GPU, else per-segment SDPA."""
    if requested != "auto":
        return requested
    if torch.cuda.is_available():
        return "flex"
    return "sdpa"


def layer_spec_for(model_cfg):
    backend = resolve_attention_backend(model_cfg.attention_backend)
    if backend == "te":
        raise NotImplementedError("the Transformer Engine layer spec is not implemented yet; use flex or sdpa")
    if model_cfg.architecture in ("dit_cross", "dit_adaln"):
        return dit_layer_local_spec(
            cross_attention=model_cfg.architecture == "dit_cross",
            qk_layernorm=model_cfg.qk_layernorm,
            attention_backend=backend,
        )
    raise NotImplementedError(f"model.architecture={model_cfg.architecture!r} is not implemented yet")


def build_model_chunk(model_cfg, precision: str, seed: int, vp_stage: Optional[int] = None):
    """One (virtual) pipeline stage of the model, initialised layout-independently from ``seed``."""
    tconfig = build_transformer_config(model_cfg, precision)
    pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    model = DiTModel(tconfig, layer_spec_for(model_cfg), model_cfg, pre_process=pre, post_process=post, vp_stage=vp_stage)
    init_params(model, seed, model.global_param_name, std=model_cfg.init_method_std)
    return model, tconfig
