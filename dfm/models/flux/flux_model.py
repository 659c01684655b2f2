"""FLUX.1 on megatron-core: double-stream (MMDiT) blocks, then single-stream blocks, over THD packs.

Each sample's joint sequence is [its text tokens, its image tokens]; the model keeps the two
streams as the text part then the image part of one hidden tensor ([s_text + s_image, 1, h], what
pipeline stages exchange) and builds the joint attention segments once per pack
(joint_attention.py). Conditioning per sample: timestep (+ guidance for guidance-distilled
models) + pooled text vector (``PackedBatch.pooled_text``), as diffusers' FluxTransformer2DModel.
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
from dfm.models.common.param_names import global_param_name
from dfm.models.common.recompute import forward_layers, layer_runs
from dfm.models.dit.dit_model import FinalLayer
from dfm.models.flux.flux_layer import FluxPackInputs
from dfm.models.flux.joint_attention import joint_attention_plan
from dfm.parallel.layout import layout_of
from dfm.parallel.sequence_split import SequenceSplit

# diffusers' FLUX embeds timestep and guidance as 1000 x their value in [0, 1].
TIME_SCALE = 1000.0


def pooled_text_embedder(pooled_dim: int, hidden_size: int) -> nn.Sequential:
    """Pooled text vector [N, D_pool] -> [N, h] (Linear, SiLU, Linear)."""
    return nn.Sequential(nn.Linear(pooled_dim, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size))


def _replicated_across_stages(module: nn.Module) -> nn.Module:
    for param in module.parameters():
        param.pipeline_parallel = True
    return module


class FluxModel(MegatronModule):
    """Packed FLUX: (x_in [S, D], t [N] in [0, 1], batch) -> velocity [S, D] (last stage)."""

    def __init__(
        self,
        config,
        layer_specs: tuple[ModuleSpec, ModuleSpec],
        model_cfg,
        pre_process: bool = True,
        post_process: bool = True,
        vp_stage: int | None = None,
    ):
        super().__init__(config=config)
        check_flux_config(model_cfg)
        self.model_type = ModelType.encoder_or_decoder
        self.share_embeddings_and_output_weights = False  # read by megatron finalize_model_grads
        self.model_cfg = model_cfg
        self.layout = layout_of(config)
        self.pre_process, self.post_process, self.vp_stage = pre_process, post_process, vp_stage
        h = config.hidden_size
        self.patch_dim = model_cfg.in_channels * model_cfg.patch_temporal * model_cfg.patch_spatial**2
        self.input_tensor: Tensor | None = None

        self.t_embedder = _replicated_across_stages(TimestepEmbedder(h))
        self.guidance_embedder = _replicated_across_stages(TimestepEmbedder(h)) if model_cfg.guidance_embeds else None
        self.pooled_embedder = _replicated_across_stages(pooled_text_embedder(model_cfg.pooled_text_dim, h))
        if pre_process:
            self.x_embedder = nn.Linear(self.patch_dim, h)
            self.context_embedder = nn.Linear(model_cfg.text_embed_dim, h)

        self.layer_offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        num_double = model_cfg.num_layers - model_cfg.num_single_layers
        double_spec, single_spec = layer_specs
        self.layers = nn.ModuleList(
            build_module(
                double_spec if self.layer_offset + i < num_double else single_spec,
                config=config,
                layer_number=self.layer_offset + i + 1,
            )
            for i in range(get_num_layers_to_build(config, vp_stage=vp_stage))
        )
        if post_process:
            self.final_layer = FinalLayer(h, self.patch_dim, config.layernorm_epsilon)

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline schedules hand the previous stage's output in here."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def global_param_name(self, name: str) -> str:
        """Local parameter name -> its name in the whole (unpipelined) model."""
        return global_param_name(name, self.layer_offset)

    def conditioning(self, t: Tensor, batch: PackedBatch, guidance: Tensor | None) -> Tensor:
        """t [N] (+ guidance [N]; None: model.guidance) + the pack's pooled text -> [N, h]."""
        if batch.pooled_text is None:
            raise ValueError(
                "FLUX needs the pack's pooled text vectors (PackedBatch.pooled_text [N, D_pool]); got none"
            )
        cond = self.t_embedder(t * TIME_SCALE)
        if self.guidance_embedder is not None:
            if guidance is None:
                guidance = torch.full_like(t, self.model_cfg.guidance)
            cond = cond + self.guidance_embedder(guidance * TIME_SCALE)
        return cond + self.pooled_embedder(batch.pooled_text.to(cond.dtype))

    def forward(self, x_in: Tensor, t: Tensor, batch: PackedBatch, guidance: Tensor | None = None) -> Tensor:
        """Under context parallelism each rank runs its share of the image tokens (and all the
        text); the output is gathered: every CP rank returns the whole [S, D]."""
        split = self.layout.pack_split(batch)
        inputs = self.pack_inputs(batch, split, self.conditioning(t, batch, guidance))
        hidden = self.embed(split.local(x_in), batch.context) if self.pre_process else self.input_tensor
        hidden = forward_layers(self.layers, layer_runs(len(self.layers), self.config, self.training), hidden, inputs)
        if not self.post_process:
            return hidden
        image = hidden[inputs.num_text :]
        if self.config.sequence_parallel:
            image = tensor_parallel.gather_from_sequence_parallel_region(image, tensor_parallel_output_grad=False)
        out = self.final_layer(image, inputs.cond, split.local(batch.token_sample_ids()))[:, 0]
        # The loss is computed on the gathered output by every CP rank alike: keep own rows' grads.
        return split.gather(out, grad_is_partial=False)

    def embed(self, image_tokens: Tensor, text: Tensor) -> Tensor:
        """image tokens [s, D], text [S_kv, D_text] -> hidden [s_text + s_image, 1, h] (SP shares)."""
        text = self.context_embedder(text.to(self.x_embedder.weight.dtype)).unsqueeze(1)
        image = self.x_embedder(image_tokens.to(self.x_embedder.weight.dtype)).unsqueeze(1)
        if self.config.sequence_parallel:
            text = tensor_parallel.scatter_to_sequence_parallel_region(text)
            image = tensor_parallel.scatter_to_sequence_parallel_region(image)
        return torch.cat([text, image])

    def pack_inputs(self, batch: PackedBatch, split: SequenceSplit, cond: Tensor) -> FluxPackInputs:
        """The blocks' inputs for this rank's share of ``batch``; cond [N, h]."""
        text_lengths = segment_lengths(batch.cu_seqlens_kv_padded).long()
        samples = torch.arange(len(text_lengths), device=text_lengths.device)
        text_ids = torch.repeat_interleave(samples, text_lengths, output_size=batch.context.shape[0])
        return FluxPackInputs(
            cond=cond,
            text_sample_ids=self.layout.sequence_parallel_slice(text_ids),
            image_sample_ids=self.layout.sequence_parallel_slice(split.local(batch.token_sample_ids())),
            attention=joint_attention_plan(batch, split, list(self.model_cfg.rope_axes_dim)),
        )


def check_flux_config(model_cfg) -> None:
    """ValueError naming the key when ``model_cfg`` cannot be a FLUX model."""
    head_dim = model_cfg.hidden_size // model_cfg.num_attention_heads
    if sum(model_cfg.rope_axes_dim) != head_dim:
        raise ValueError(
            f"model.rope_axes_dim {list(model_cfg.rope_axes_dim)} must sum to the head dim "
            f"hidden_size / num_attention_heads = {head_dim}"
        )
    if not model_cfg.qk_layernorm:
        raise ValueError("FLUX normalises queries and keys per head: set model.qk_layernorm=true")
    if not 0 <= model_cfg.num_single_layers <= model_cfg.num_layers:
        raise ValueError(
            f"model.num_single_layers ({model_cfg.num_single_layers}) must be in [0, model.num_layers="
            f"{model_cfg.num_layers}] (the blocks, double- then single-stream)"
        )
    if model_cfg.pooled_text_dim is None:
        raise ValueError("FLUX conditions on a pooled text vector: set model.pooled_text_dim (768 for CLIP-L)")
