"""FLUX.1 on megatron-core: double-stream (MMDiT) blocks, then single-stream blocks, over THD packs.

Each sample's joint sequence is [its text tokens, its image tokens]; the model keeps the two
streams as the text part then the image part of one hidden tensor ([s_text + s_image, 1, h], what
pipeline stages exchange) and builds the joint attention segments once per pack
(joint_attention.py). Conditioning per sample: timestep (+ guidance for guidance-distilled
models) + pooled text vector (``PackedBatch.pooled_text``), as diffusers' FluxTransformer2DModel.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dfm.data.packed_batch import PackedBatch, segment_lengths
from dfm.models.common.embeddings import TimestepEmbedder
from dfm.models.common.final_layer import FinalLayer
from dfm.models.common.packed_model import PackedDiffusionModel
from dfm.models.flux.flux_layer import FluxPackInputs
from dfm.models.flux.joint_attention import joint_attention_plan
from dfm.parallel.sequence_split import SequenceSplit

# diffusers' FLUX embeds timestep and guidance as 1000 x their value in [0, 1].
TIME_SCALE = 1000.0


def pooled_text_embedder(pooled_dim: int, hidden_size: int) -> nn.Sequential:
    """Pooled text vector [N, D_pool] -> [N, h] (Linear, SiLU, Linear)."""
    return nn.Sequential(nn.Linear(pooled_dim, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size))


class FluxModel(PackedDiffusionModel):
    """Packed FLUX: (x_in [S, D], t [N] in [0, 1], batch, guidance [N] | None) -> velocity [S, D].

    ``layer_spec``: (double-stream block, single-stream block) specs (flux_spec.py)."""

    def __init__(self, config, layer_spec, model_cfg, pre_process=True, post_process=True, vp_stage=None):
        check_flux_config(model_cfg)
        super().__init__(config, layer_spec, model_cfg, pre_process, post_process, vp_stage)

    def build_conditioning(self) -> dict[str, nn.Module | None]:
        cfg, h = self.model_cfg, self.config.hidden_size
        return {
            "t_embedder": TimestepEmbedder(h),
            "guidance_embedder": TimestepEmbedder(h) if cfg.guidance_embeds else None,
            "pooled_embedder": pooled_text_embedder(cfg.pooled_text_dim, h),
        }

    def build_embedding(self) -> dict[str, nn.Module]:
        h = self.config.hidden_size
        return {
            "x_embedder": nn.Linear(self.patch_dim, h),
            "context_embedder": nn.Linear(self.model_cfg.text_embed_dim, h),
        }

    def block_spec(self, layer_spec, global_index: int):
        """The first num_layers - num_single_layers blocks are double-stream, the rest single-stream."""
        double_spec, single_spec = layer_spec
        num_double = self.model_cfg.num_layers - self.model_cfg.num_single_layers
        return double_spec if global_index < num_double else single_spec

    def build_head(self, layer_spec) -> nn.Module:
        return FinalLayer(self.config.hidden_size, self.patch_dim, self.config.layernorm_epsilon)

    def condition(self, noise_level: Tensor, batch: PackedBatch, extra: Tensor | None) -> Tensor:
        return self.conditioning(noise_level, batch, extra)

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

    def embed(self, x_local: Tensor, batch: PackedBatch, split: SequenceSplit) -> Tensor:
        """image tokens [s, D], text [S_kv, D_text] -> hidden [s_text + s_image, 1, h] (SP shares):
        the text part, then the image part (what pipeline stages exchange)."""
        dtype = self.x_embedder.weight.dtype
        text = self.context_embedder(batch.context.to(dtype)).unsqueeze(1)
        image = self.x_embedder(x_local.to(dtype)).unsqueeze(1)
        return torch.cat([self.scatter_sequence(text), self.scatter_sequence(image)])

    def head_output(self, hidden: Tensor, inputs: FluxPackInputs, token_ids: Tensor) -> Tensor:
        return self.final_layer(self.latent_hidden(hidden, inputs), inputs.cond, token_ids)[:, 0]

    def latent_hidden(self, hidden: Tensor, inputs: FluxPackInputs) -> Tensor:
        """The image tokens (the sequence's second part), gathered over SP."""
        return self.gather_sequence(hidden[inputs.num_text :])

    def pack_inputs(
        self, batch: PackedBatch, split: SequenceSplit, cond: Tensor, token_ids: Tensor | None = None
    ) -> FluxPackInputs:
        """The blocks' inputs for this rank's share of ``batch``; cond [N, h]."""
        if token_ids is None:
            token_ids = split.local(batch.token_sample_ids())
        joint, num_text = self.joint_text(batch)
        text_lengths = segment_lengths(joint.cu_seqlens_kv_padded).long()
        samples = torch.arange(len(text_lengths), device=text_lengths.device)
        text_ids = torch.repeat_interleave(samples, text_lengths, output_size=num_text)
        cfg = self.model_cfg
        return FluxPackInputs(
            cond=cond,
            text_sample_ids=self.layout.sequence_parallel_slice(text_ids),
            image_sample_ids=self.layout.sequence_parallel_slice(token_ids),
            attention=joint_attention_plan(joint, split, list(cfg.rope_axes_dim), cfg.rope_theta),
        )

    def joint_text(self, batch: PackedBatch) -> tuple[PackedBatch, int]:
        """(``batch`` with the text stream's segments as its cu_seqlens_kv, the stream's rows S_kv):
        FLUX's text stream is the pack's text."""
        return batch, batch.context.shape[0]


def check_joint_attention_heads(model_cfg, model_name: str) -> None:
    """ValueError naming the key when the heads of ``model_cfg`` cannot run the joint attention of
    FLUX's double-stream block (RoPE over the whole head, per-head q/k norms)."""
    head_dim = model_cfg.hidden_size // model_cfg.num_attention_heads
    if sum(model_cfg.rope_axes_dim) != head_dim:
        raise ValueError(
            f"model.rope_axes_dim {list(model_cfg.rope_axes_dim)} must sum to the head dim "
            f"hidden_size / num_attention_heads = {head_dim}"
        )
    if not model_cfg.qk_layernorm:
        raise ValueError(f"{model_name} normalises queries and keys per head: set model.qk_layernorm=true")


def check_flux_config(model_cfg) -> None:
    """ValueError naming the key when ``model_cfg`` cannot be a FLUX model."""
    check_joint_attention_heads(model_cfg, "FLUX")
    if not 0 <= model_cfg.num_single_layers <= model_cfg.num_layers:
        raise ValueError(
            f"model.num_single_layers ({model_cfg.num_single_layers}) must be in [0, model.num_layers="
            f"{model_cfg.num_layers}] (the blocks, double- then single-stream)"
        )
    if model_cfg.pooled_text_dim is None:
        raise ValueError("FLUX conditions on a pooled text vector: set model.pooled_text_dim (768 for CLIP-L)")
