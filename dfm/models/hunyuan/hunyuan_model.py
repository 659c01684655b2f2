"""HunyuanVideo 1.5 on megatron-core: dual-stream (MMDiT) blocks over THD packs of video clips.

The blocks are FLUX's double-stream block (dfm/models/flux/flux_layer.py: per-stream adaLN-Zero,
q/k/v with per-head RMSNorm, GELU-tanh MLP, one joint attention with RoPE on the video tokens only).
What differs is around them:

* video tokens: [noisy latents, condition latents, mask] per token (65 channels for 32-channel
  latents), patch 1x1x1; RoPE over (t, h, w) with base 256;
* text stream per sample: [SigLIP image tokens (image-to-video only), ByT5 tokens, refined Qwen2.5-VL
  tokens], each source plus its condition-type embedding (text_stream.py, embedders.py);
* conditioning: the timestep alone (c_noise = 1000 t), the refiner adds the pooled Qwen text for its own gates.
"""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from torch import Tensor, nn

from dfm.data.packed_batch import PackedBatch, segment_lengths
from dfm.models.common.embeddings import TimestepEmbedder
from dfm.models.common.init import zero_init
from dfm.models.common.param_names import global_param_name
from dfm.models.common.recompute import forward_layers, layer_runs
from dfm.models.dit.dit_model import FinalLayer
from dfm.models.dit.dit_spec import BackendModules
from dfm.models.flux.flux_layer import FluxPackInputs
from dfm.models.flux.flux_model import _replicated_across_stages
from dfm.models.flux.flux_spec import flux_layer_specs
from dfm.models.flux.joint_attention import joint_attention_plan
from dfm.models.hunyuan.embedders import TokenRefiner, byt5_embedder, image_embedder
from dfm.models.hunyuan.text_stream import TextStreamPlan, text_stream_plan, text_view
from dfm.parallel.layout import layout_of
from dfm.parallel.sequence_split import SequenceSplit

QWEN, BYT5, IMAGE = 0, 1, 2  # rows of the condition-type embedding


def hunyuan_layer_spec(modules: BackendModules) -> ModuleSpec:
    """The dual-stream block: FLUX's double-stream block."""
    return flux_layer_specs(modules)[0]


def condition_channels(model_cfg) -> int:
    """Per-token condition features: the condition latents and one mask channel."""
    return model_cfg.in_channels + 1


class HunyuanVideo15Model(MegatronModule):
    """Packed HunyuanVideo 1.5: (x_in [S, C], c_noise [N] = 1000 t, batch) -> velocity [S, C] (last stage).

    ``batch.condition`` [S, C + 1] is appended to x_in (None: zeros, text-to-video)."""

    def __init__(self, config, layer_spec: ModuleSpec, model_cfg, pre_process=True, post_process=True, vp_stage=None):
        super().__init__(config=config)
        check_hunyuan_config(model_cfg)
        self.model_type = ModelType.encoder_or_decoder
        self.share_embeddings_and_output_weights = False  # read by megatron finalize_model_grads
        self.model_cfg = model_cfg
        self.layout = layout_of(config)
        self.pre_process, self.post_process, self.vp_stage = pre_process, post_process, vp_stage
        self.input_tensor: Tensor | None = None
        h, c = config.hidden_size, model_cfg.in_channels
        self.t_embedder = _replicated_across_stages(TimestepEmbedder(h))
        if pre_process:
            self.x_embedder = nn.Linear(c + condition_channels(model_cfg), h)
            self.refiner = TokenRefiner(
                model_cfg.text_embed_dim, h, config.num_attention_heads, model_cfg.num_refiner_layers
            )
            self.refiner_attention = build_module(layer_spec.submodules.core_attention, config=config, layer_number=1)
            self.byt5_embedder = byt5_embedder(model_cfg.text_embed_2_dim, h)
            self.image_embedder = image_embedder(model_cfg.image_embed_dim, h)
            self.cond_type_embed = nn.Embedding(3, h)
        self.layer_offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        self.layers = nn.ModuleList(
            build_module(layer_spec, config=config, layer_number=self.layer_offset + i + 1)
            for i in range(get_num_layers_to_build(config, vp_stage=vp_stage))
        )
        if post_process:
            self.final_layer = FinalLayer(h, model_cfg.out_channels or c, config.layernorm_epsilon)
        if pre_process:
            zero_init(self.refiner.blocks)  # refiner gates are adaLN-Zero too: a fresh refiner is proj_in

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline schedules hand the previous stage's output in here."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def global_param_name(self, name: str) -> str:
        """Local parameter name -> its name in the whole (unpipelined) model."""
        return global_param_name(name, self.layer_offset)

    def forward(self, x_in: Tensor, c_noise: Tensor, batch: PackedBatch) -> Tensor:
        """Under context parallelism each rank runs its share of the video tokens (and all the
        text); the output is gathered: every CP rank returns the whole [S, C]."""
        split = self.layout.pack_split(batch)
        text_plan = text_stream_plan(batch, self.layout.padding_multiples()[1] // self.layout.padding_multiples()[0])
        inputs = self.pack_inputs(batch, split, text_plan, self.t_embedder(c_noise))
        if self.pre_process:
            hidden = self.embed(split.local(self.video_tokens(x_in, batch)), c_noise, batch, text_plan)
        else:
            hidden = self.input_tensor
        hidden = forward_layers(self.layers, layer_runs(len(self.layers), self.config, self.training), hidden, inputs)
        if not self.post_process:
            return hidden
        video = hidden[inputs.num_text :]
        if self.config.sequence_parallel:
            video = tensor_parallel.gather_from_sequence_parallel_region(video, tensor_parallel_output_grad=False)
        out = self.final_layer(video, inputs.cond, split.local(batch.token_sample_ids()))[:, 0]
        # The loss is computed on the gathered output by every CP rank alike: keep own rows' grads.
        return split.gather(out, grad_is_partial=False)

    def video_tokens(self, x_in: Tensor, batch: PackedBatch) -> Tensor:
        """[S, C] -> [S, 2C + 1]: the noisy latents, then the condition latents and mask."""
        condition = batch.condition
        if condition is None:
            condition = x_in.new_zeros(x_in.shape[0], condition_channels(self.model_cfg))
        return torch.cat([x_in, condition.to(x_in.dtype)], dim=-1)

    def text_stream(self, c_noise: Tensor, batch: PackedBatch, plan: TextStreamPlan) -> Tensor:
        """The three text sources embedded, typed and laid out per sample -> [T, h]."""
        dtype = self.x_embedder.weight.dtype
        types = self.cond_type_embed.weight
        qwen = self.refiner(batch.context.to(dtype), c_noise, plan, self.refiner_attention) + types[QWEN]
        parts = [qwen]
        if batch.context_2 is not None:
            parts.insert(0, self.byt5_embedder(batch.context_2.to(dtype)) + types[BYT5])
        if len(plan.i2v_samples):
            images = batch.image_embeds[plan.i2v_samples].flatten(0, 1).to(dtype)
            parts.insert(0, self.image_embedder(images) + types[IMAGE])
        parts.append(qwen.new_zeros(1, qwen.shape[1]))
        return torch.cat(parts)[plan.order]

    def embed(self, video_tokens: Tensor, c_noise: Tensor, batch: PackedBatch, plan: TextStreamPlan) -> Tensor:
        """video tokens [s, 2C + 1] -> hidden [s_text + s_video, 1, h] (SP shares)."""
        text = self.text_stream(c_noise, batch, plan).unsqueeze(1)
        video = self.x_embedder(video_tokens.to(self.x_embedder.weight.dtype)).unsqueeze(1)
        if self.config.sequence_parallel:
            text = tensor_parallel.scatter_to_sequence_parallel_region(text)
            video = tensor_parallel.scatter_to_sequence_parallel_region(video)
        return torch.cat([text, video])

    def pack_inputs(
        self, batch: PackedBatch, split: SequenceSplit, plan: TextStreamPlan, cond: Tensor
    ) -> FluxPackInputs:
        """The blocks' inputs for this rank's share of ``batch``; cond [N, h]."""
        joint = text_view(batch, plan)
        text_lengths = segment_lengths(joint.cu_seqlens_kv_padded).long()
        samples = torch.arange(len(text_lengths), device=text_lengths.device)
        text_ids = torch.repeat_interleave(samples, text_lengths, output_size=int(plan.cu_padded[-1]))
        return FluxPackInputs(
            cond=cond,
            text_sample_ids=self.layout.sequence_parallel_slice(text_ids),
            image_sample_ids=self.layout.sequence_parallel_slice(split.local(batch.token_sample_ids())),
            attention=joint_attention_plan(joint, split, list(self.model_cfg.rope_axes_dim), self.model_cfg.rope_theta),
        )


def check_hunyuan_config(model_cfg) -> None:
    """ValueError naming the key when ``model_cfg`` cannot be a HunyuanVideo 1.5 model."""
    head_dim = model_cfg.hidden_size // model_cfg.num_attention_heads
    if sum(model_cfg.rope_axes_dim) != head_dim:
        raise ValueError(
            f"model.rope_axes_dim {list(model_cfg.rope_axes_dim)} must sum to the head dim "
            f"hidden_size / num_attention_heads = {head_dim}"
        )
    if not model_cfg.qk_layernorm:
        raise ValueError("HunyuanVideo 1.5 normalises queries and keys per head: set model.qk_layernorm=true")
    if model_cfg.patch_spatial != 1 or model_cfg.patch_temporal != 1:
        raise ValueError("HunyuanVideo 1.5 patches are 1x1x1: set model.patch_spatial=1 and model.patch_temporal=1")
    for key in ("text_embed_2_dim", "image_embed_dim"):
        if getattr(model_cfg, key) is None:
            raise ValueError(f"HunyuanVideo 1.5 needs model.{key} (1472 for ByT5, 1152 for SigLIP)")
