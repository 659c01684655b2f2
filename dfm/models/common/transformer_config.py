"""Our ModelConfig (+ parallel layout, precision) -> ``DfmTransformerConfig``: megatron-core's
TransformerConfig plus the settings dfm's own modules read, declared as fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from dfm.models.common.fused import activation
from dfm.parallel.layout import ParallelLayout

# megatron's own fused kernels, off: dfm's blocks fuse their elementwise regions themselves (fused.py).
UNFUSED = dict.fromkeys(
    (
        "bias_activation_fusion",
        "bias_dropout_fusion",
        "masked_softmax_fusion",
        "apply_rope_fusion",
        "gradient_accumulation_fusion",
        "persist_layer_norm",
    ),
    False,
)


@dataclass
class DfmTransformerConfig(TransformerConfig):
    """TransformerConfig with dfm's per-run settings as declared fields (not attributes set on
    megatron's object)."""

    parallel_layout: ParallelLayout | None = None  # read through `dfm.parallel.layout_of`
    compile_regions: bool = False  # the blocks' fused regions (dfm/models/common/fused.py)
    adaln_lora_dim: int | None = None  # low-rank adaLN projection (dfm/models/common/adaln.py)
    cross_attention_dim: int | None = None  # text context width (dfm/models/dit/dit_layer.py)
    # Timestep / text embedders are replicated on every pipeline stage; megatron's
    # finalize_model_grads all-reduces grads of params marked `pipeline_parallel` across stages
    # when this flag is set (dfm.models.common.packed_model.replicate_across_stages).
    has_cond_embedder: bool = True
    # The MLP's activation output recomputed in backward, not kept (dfm/models/common/activation_mlp.py).
    recompute_activation: bool = False
    # mixed_precision.fp8: the block linears' products in FP8 (dfm/models/common/fp8_linear.py); None: off.
    fp8_linears: str | None = None


def build_transformer_config(
    model,
    layout: ParallelLayout,
    precision: str = "fp32",
    family_settings: dict[str, Any] | None = None,
    fp8: str | None = None,
) -> DfmTransformerConfig:
    """``model`` is a dfm.config ModelConfig; ``precision`` in fp32 | bf16 | fp16; ``fp8``: the recipe of
    the block linears' products (``mixed_precision.fp8``), None for none. The config
    carries ``layout`` for the model's modules (`dfm.parallel.layout_of`); ``family_settings``:
    the block fields the model's family sets otherwise (``Family.transformer_settings``)."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    block = {
        "normalization": "RMSNorm" if model.normalization == "rmsnorm" else "LayerNorm",
        "gated_linear_unit": False,
        "activation_func": activation(gated=False, compile=model.compile),
        "add_bias_linear": model.add_bias_linear,
        "qk_layernorm": model.qk_layernorm,
        "rotary_interleaved": False,
    }
    block.update(family_settings or {})
    return DfmTransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        ffn_hidden_size=model.effective_ffn_hidden_size,
        kv_channels=model.hidden_size // model.num_attention_heads,
        **layout.megatron_parallel_kwargs(),
        sequence_parallel=layout.sp,
        num_moe_experts=model.num_moe_experts,
        moe_router_topk=model.moe_router_topk,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size,
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="alltoall",
        moe_aux_loss_coeff=model.moe_aux_loss_coeff if model.num_moe_experts else 0.0,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        layernorm_epsilon=model.layernorm_epsilon,
        **block,
        init_method_std=model.init_method_std,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        # Parameters are created on the CPU and filled by dfm.models.common.init (layout independent).
        use_cpu_initialization=True,
        perform_initialization=False,
        # Packs vary in length: pipeline stages exchange shapes before tensors.
        variable_seq_lengths=True,
        **UNFUSED,
        recompute_granularity=model.recompute_granularity,
        recompute_method=model.recompute_method if model.recompute_granularity == "full" else None,
        recompute_num_layers=(model.recompute_num_layers or 1) if model.recompute_granularity == "full" else None,
        parallel_layout=layout,
        compile_regions=model.compile,
        recompute_activation=model.recompute_activation,
        adaln_lora_dim=model.adaln_lora_dim,
        cross_attention_dim=model.context_width,
        fp8_linears=fp8,
    )
