"""HunyuanVideo 1.5 on megatron-core: dual-stream (MMDiT) blocks over THD packs of video clips.

The blocks are FLUX's double-stream block (dfm/models/flux/flux_layer.py: per-stream adaLN-Zero,
q/k/v with per-head RMSNorm, GELU-tanh MLP, one joint attention with RoPE on the video tokens only)
and the model is FLUX's on the shared scaffold (dfm/models/common/packed_model.py). What differs:

* video tokens: [noisy latents, condition latents, mask] per token (65 channels for 32-channel
  latents), patch 1x1x1; RoPE over (t, h, w) with base 256;
* text stream per sample: [SigLIP image tokens (image-to-video only), ByT5 tokens, refined Qwen2.5-VL
  tokens], each source plus its condition-type embedding (text_stream.py, embedders.py);
* conditioning: the timestep alone (c_noise = 1000 t); the refiner adds the pooled Qwen text for its own gates.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from torch import Tensor, nn

from dfm.data.packed_batch import PackedBatch
from dfm.models.attention.modules import BackendModules
from dfm.models.common.embeddings import TimestepEmbedder
from dfm.models.common.final_layer import FinalLayer
from dfm.models.common.init import zero_init
from dfm.models.flux.flux_model import FluxModel, check_joint_attention_heads
from dfm.models.flux.flux_spec import flux_layer_specs
from dfm.models.hunyuan.embedders import TokenRefiner, byt5_embedder, image_embedder
from dfm.models.hunyuan.text_stream import TextStreamPlan, text_stream_plan, text_view
from dfm.parallel.sequence_split import SequenceSplit

QWEN, BYT5, IMAGE = 0, 1, 2  # rows of the condition-type embedding


def hunyuan_layer_spec(model_cfg, modules: BackendModules) -> ModuleSpec:
    """The dual-stream block: FLUX's double-stream block."""
    return flux_layer_specs(model_cfg, modules)[0]


def condition_channels(model_cfg) -> int:
    """Per-token condition features: the condition latents and one mask channel."""
    return model_cfg.in_channels + 1


class HunyuanVideo15Model(FluxModel):
    """Packed HunyuanVideo 1.5: (x_in [S, C], c_noise [N] = 1000 t, batch) -> velocity [S, C] (last stage).

    ``batch.condition`` [S, C + 1] is appended to x_in (None: zeros, text-to-video). FLUX's scaffold
    hooks, except the embedders, conditioning and text stream."""

    def __init__(self, config, layer_spec, model_cfg, pre_process=True, post_process=True, vp_stage=None):
        check_hunyuan_config(model_cfg)
        self.core_attention_spec = layer_spec.submodules.core_attention
        # The scaffold's init, not FluxModel's: FLUX's config check (a pooled text vector) does not apply.
        super(FluxModel, self).__init__(config, layer_spec, model_cfg, pre_process, post_process, vp_stage)
        self.text_plan: TextStreamPlan | None = None  # this pack's, set by joint_text (pack_inputs)
        self.c_noise: Tensor | None = None  # this pack's timesteps, for the refiner (first stage)

    def build_conditioning(self) -> dict[str, nn.Module | None]:
        return {"t_embedder": TimestepEmbedder(self.config.hidden_size)}

    def build_embedding(self) -> dict[str, nn.Module]:
        cfg, h = self.model_cfg, self.config.hidden_size
        refiner = TokenRefiner(cfg.text_embed_dim, h, self.config.num_attention_heads, cfg.num_refiner_layers)
        zero_init(refiner.blocks)  # the refiner's gates are adaLN-Zero too: a fresh refiner is proj_in
        return {
            "x_embedder": nn.Linear(cfg.in_channels + condition_channels(cfg), h),
            "refiner": refiner,
            "refiner_attention": build_module(self.core_attention_spec, config=self.config, layer_number=1),
            "byt5_embedder": byt5_embedder(cfg.text_embed_2_dim, h),
            "image_embedder": image_embedder(cfg.image_embed_dim, h),
            "cond_type_embed": nn.Embedding(3, h),
        }

    def block_spec(self, layer_spec, global_index: int) -> ModuleSpec:
        return layer_spec

    def build_head(self, layer_spec) -> nn.Module:
        out = self.model_cfg.out_channels or self.model_cfg.in_channels
        return FinalLayer(self.config.hidden_size, out, self.config.layernorm_epsilon)

    def forward(self, x_in: Tensor, c_noise: Tensor, batch: PackedBatch, extra: Tensor | None = None) -> Tensor:
        self.c_noise = c_noise  # the refiner's timestep input (embed runs after pack_inputs)
        return super().forward(x_in, c_noise, batch, extra)

    def condition(self, noise_level: Tensor, batch: PackedBatch, extra: Tensor | None) -> Tensor:
        return self.t_embedder(noise_level)

    def embed(self, x_local: Tensor, batch: PackedBatch, split: SequenceSplit) -> Tensor:
        """video tokens [s, C] -> hidden [s_text + s_video, 1, h] (SP shares): the text stream, then the video."""
        condition = batch.condition
        if condition is None:
            condition = batch.latents.new_zeros(batch.seq_len, condition_channels(self.model_cfg))
        tokens = torch.cat([x_local, split.local(condition).to(x_local.dtype)], dim=-1)
        video = self.x_embedder(tokens.to(self.x_embedder.weight.dtype)).unsqueeze(1)
        text = self.text_stream(batch).unsqueeze(1)
        return torch.cat([self.scatter_sequence(text), self.scatter_sequence(video)])

    def text_stream(self, batch: PackedBatch) -> Tensor:
        """The three text sources embedded, typed and laid out per sample -> [T, h]."""
        plan, dtype, types = self.text_plan, self.x_embedder.weight.dtype, self.cond_type_embed.weight
        qwen = self.refiner(batch.context.to(dtype), self.c_noise, plan, self.refiner_attention) + types[QWEN]
        parts = [qwen]
        if batch.context_2 is not None:
            parts.insert(0, self.byt5_embedder(batch.context_2.to(dtype)) + types[BYT5])
        if len(plan.i2v_samples):
            images = batch.image_embeds[plan.i2v_samples].flatten(0, 1).to(dtype)
            parts.insert(0, self.image_embedder(images) + types[IMAGE])
        parts.append(qwen.new_zeros(1, qwen.shape[1]))
        return torch.cat(parts)[plan.order]

    def joint_text(self, batch: PackedBatch) -> tuple[PackedBatch, int]:
        """``batch`` with its text stream's segments (this pack's plan, kept for ``text_stream``)."""
        segment, total = self.layout.padding_multiples()
        self.text_plan = text_stream_plan(batch, total // segment)
        return text_view(batch, self.text_plan), int(self.text_plan.cu_padded[-1])


def check_hunyuan_config(model_cfg) -> None:
    """ValueError naming the key when ``model_cfg`` cannot be a HunyuanVideo 1.5 model."""
    check_joint_attention_heads(model_cfg, "HunyuanVideo 1.5")
    if model_cfg.patch_spatial != 1 or model_cfg.patch_temporal != 1:
        raise ValueError("HunyuanVideo 1.5 patches are 1x1x1: set model.patch_spatial=1 and model.patch_temporal=1")
    for key in ("text_embed_2_dim", "image_embed_dim"):
        if getattr(model_cfg, key) is None:
            raise ValueError(f"HunyuanVideo 1.5 needs model.{key} (1472 for ByT5, 1152 for SigLIP)")
