"""Our ModelConfig (+ parallel layout, precision) -> megatron-core TransformerConfig."""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from dfm.models.common.fused import activation
from dfm.parallel.layout import ParallelLayout


def build_transformer_config(model, layout: ParallelLayout, precision: str = "fp32") -> TransformerConfig:
    """``model`` is a dfm.config ModelConfig; ``precision`` in fp32 | bf16 | fp16. The config
    carries ``layout`` for the model's modules (`dfm.parallel.layout_of`)."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    llama_style = model.architecture == "moviegen"
    config = TransformerConfig(
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
        normalization="RMSNorm" if llama_style or model.normalization == "rmsnorm" else "LayerNorm",
        gated_linear_unit=llama_style,
        activation_func=activation(gated=llama_style, compile=model.compile),
        add_bias_linear=model.add_bias_linear and not llama_style,
        # megatron sums the grads of q/k norms over TP, as if they were per head and replicated: Wan's
        # are across heads and TP-sharded (dfm/models/wan/norms.py), so its spec adds them instead.
        qk_layernorm=model.qk_layernorm and model.architecture != "wan",
        rotary_interleaved=model.architecture == "wan",  # Wan rotates channel pairs (2i, 2i+1)
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
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        recompute_granularity=model.recompute_granularity,
        recompute_method=model.recompute_method if model.recompute_granularity == "full" else None,
        recompute_num_layers=(model.recompute_num_layers or 1) if model.recompute_granularity == "full" else None,
    )
    # Timestep / text embedders are replicated on every pipeline stage; megatron all-reduces
    # grads of params marked `pipeline_parallel` across stages when this flag is set.
    config.has_cond_embedder = True
    # Read by the DiT blocks (dfm/models/dit/dit_layer.py, dfm/models/common/adaln.py).
    config.adaln_lora_dim = model.adaln_lora_dim
    config.cross_attention_dim = model.context_width
    config.compile_regions = model.compile  # read by the blocks (dfm/models/common/fused.py)
    layout.attach_to(config)
    return config
