"""DiT on megatron-core: patch embed -> DiT blocks (built from a ModuleSpec) -> adaLN final layer.

Inputs are THD packs (see dfm/data/packed_batch.py): tokens of several samples concatenated,
b == 1. The timestep and text embedders live on every pipeline stage (their grads are
all-reduced across stages by megatron), the patch embedding on the first, the final layer on the last.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from torch import Tensor, nn

from dfm.data.packed_batch import PackedBatch
from dfm.models.common.adaln import AdaLNNorm, modulate, rows_to_tokens
from dfm.models.common.context_parallel import UlyssesAttention, local_query_attention
from dfm.models.common.embeddings import (
    FactorizedLearned3DEmbedding,
    TimestepEmbedder,
    rope_3d_freqs,
    sincos_3d,
)
from dfm.models.common.factorized_layout import factorized_params, sample_grids
from dfm.models.common.init import zero_init
from dfm.models.common.pack_inputs import PackInputs
from dfm.models.common.packed_attention import PackedSegments
from dfm.models.common.param_names import global_param_name
from dfm.models.common.recompute import forward_layers, layer_runs
from dfm.models.dit.dit_layer import block_norm
from dfm.parallel.layout import layout_of
from dfm.parallel.sequence_split import SequenceSplit


class FinalLayer(nn.Module):
    """adaLN-modulated norm + linear to patch features; zero-initialised as in DiT."""

    def __init__(self, hidden_size: int, out_features: int, eps: float, norm: type = AdaLNNorm):
        super().__init__()
        self.norm = norm(hidden_size, eps)
        self.adaln = zero_init(nn.Linear(hidden_size, 2 * hidden_size))
        self.linear = zero_init(nn.Linear(hidden_size, out_features))

    def forward(self, hidden: Tensor, cond: Tensor, token_sample_ids: Tensor) -> Tensor:
        """hidden [s, b, h], cond [N, h] -> [s, b, out]."""
        shift, scale = rows_to_tokens(self.adaln(F.silu(cond)), token_sample_ids).unsqueeze(1).chunk(2, dim=-1)
        return self.linear(modulate(self.norm(hidden), shift, scale))


class TextEmbedder(nn.Module):
    """T5 features [s_kv, D_text] -> [s_kv, width] (the cross-attention's key/value input; width is
    the hidden size unless ``cross_attention_dim`` narrows it)."""

    def __init__(self, text_dim: int, hidden_size: int):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(text_dim, hidden_size), nn.GELU(approximate="tanh"), nn.Linear(hidden_size, hidden_size)
        )

    def forward(self, context: Tensor) -> Tensor:
        return self.mlp(context)


def _mark_replicated_across_stages(module: nn.Module) -> None:
    for param in module.parameters():
        param.pipeline_parallel = True


def packed_seq_params(batch: PackedBatch, cross: bool, split: SequenceSplit | None = None) -> PackedSeqParams:
    """Segment boundaries for self-attention (video-video) or cross-attention (video-text);
    with a CP ``split``, the attention of this rank's share of the queries."""
    kv = "kv" if cross else "q"

    def segments(source: PackedBatch) -> PackedSegments:
        return PackedSegments(
            qkv_format="sbhd",
            cu_seqlens_q=source.cu_seqlens_q,
            cu_seqlens_q_padded=source.cu_seqlens_q_padded,
            cu_seqlens_kv=getattr(source, f"cu_seqlens_{kv}"),
            cu_seqlens_kv_padded=getattr(source, f"cu_seqlens_{kv}_padded"),
        )

    params = segments(batch)
    if batch.host is not None:
        params.host = segments(batch.host)
    if split is not None and split.size > 1:
        params.context_parallel = local_query_attention(params, split, self_attention=not cross)
    return params


class DiTModel(MegatronModule):
    """Packed DiT: (x_in [S, D], c_noise [N], batch) -> raw prediction [S, D] (last stage)."""

    def __init__(
        self,
        config,
        layer_spec: ModuleSpec,
        model_cfg,
        pre_process: bool = True,
        post_process: bool = True,
        vp_stage: int | None = None,
    ):
        super().__init__(config=config)
        self.model_type = ModelType.encoder_or_decoder
        self.share_embeddings_and_output_weights = False  # read by megatron finalize_model_grads
        self.model_cfg = model_cfg
        self.layout = layout_of(config)
        self.pre_process, self.post_process, self.vp_stage = pre_process, post_process, vp_stage
        h = config.hidden_size
        patch_volume = model_cfg.patch_temporal * model_cfg.patch_spatial**2
        self.patch_dim = model_cfg.in_channels * patch_volume
        # DiT's learned-sigma head predicts 2x channels; forward returns the first patch_dim (the mean).
        self.out_dim = (model_cfg.out_channels or model_cfg.in_channels) * patch_volume
        self.cross = model_cfg.architecture != "dit_adaln"
        self.input_tensor: Tensor | None = None

        self.t_embedder = TimestepEmbedder(h)
        _mark_replicated_across_stages(self.t_embedder)
        if self.cross:
            self.text_embedder = TextEmbedder(model_cfg.text_embed_dim, model_cfg.context_width)
            _mark_replicated_across_stages(self.text_embedder)
        if model_cfg.num_classes:
            # One extra row is the null class for classifier-free guidance.
            self.class_embedder = nn.Embedding(model_cfg.num_classes + 1, h)
            _mark_replicated_across_stages(self.class_embedder)
        if pre_process:
            self.x_embedder = nn.Linear(self.patch_dim, h)
            if model_cfg.pos_embedding == "learned3d":
                self.pos_embedder = FactorizedLearned3DEmbedding(tuple(model_cfg.max_latent_thw), h)

        self.layer_offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        num_local = get_num_layers_to_build(config, vp_stage=vp_stage)
        self.layers = nn.ModuleList(
            build_module(layer_spec, config=config, layer_number=self.layer_offset + i + 1) for i in range(num_local)
        )
        if post_process:
            self.final_layer = FinalLayer(
                h, self.out_dim, config.layernorm_epsilon, block_norm(config, layer_spec.submodules.norm)
            )

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline schedules hand the previous stage's output in here."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def global_param_name(self, name: str) -> str:
        """Local parameter name -> its name in the whole (unpipelined, one expert rank) model."""
        return global_param_name(name, self.layer_offset, self.config.num_moe_experts)

    def conditioning(self, c_noise: Tensor, class_labels: Tensor | None) -> Tensor:
        """[N] noise levels (+ [N] labels; None: the null class) -> [N, h]."""
        cond = self.t_embedder(c_noise)
        if self.model_cfg.num_classes:
            if class_labels is None:
                class_labels = torch.full_like(c_noise, self.model_cfg.num_classes, dtype=torch.long)
            cond = cond + self.class_embedder(class_labels)
        return cond

    def embed_patches(self, x_in: Tensor, pos_ids: Tensor) -> Tensor:
        """[S, D] -> [S, 1, h] with absolute positions added when configured."""
        hidden = self.x_embedder(x_in.to(self.x_embedder.weight.dtype))
        if self.model_cfg.pos_embedding == "sincos3d":
            hidden = hidden + sincos_3d(pos_ids, hidden.shape[-1]).to(hidden.dtype)
        elif self.model_cfg.pos_embedding == "learned3d":
            hidden = hidden + self.pos_embedder(pos_ids)
        return hidden.unsqueeze(1)

    def forward(self, x_in: Tensor, c_noise: Tensor, batch: PackedBatch, class_labels: Tensor | None = None) -> Tensor:
        """Under context parallelism each rank runs its share of the tokens (``split``) and the
        output is gathered: every CP rank returns the whole [S, D]."""
        sp = self.config.sequence_parallel
        split = self.layout.pack_split(batch)
        token_ids = split.local(batch.token_sample_ids())
        inputs = self.pack_inputs(batch, split, self.conditioning(c_noise, class_labels), token_ids)
        if self.pre_process:
            hidden = self.embed_patches(split.local(x_in), split.local(batch.pos_ids))
            if sp:
                hidden = tensor_parallel.scatter_to_sequence_parallel_region(hidden)
        else:
            hidden = self.input_tensor
        hidden = self.run_layers(hidden, inputs)
        if not self.post_process:
            return hidden
        if sp:
            hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        out = self.final_layer(hidden, inputs.cond, token_ids)[:, 0, : self.patch_dim]
        # The loss is computed on the gathered output by every CP rank alike: keep own rows' grads.
        return split.gather(out, grad_is_partial=False)

    def pack_inputs(
        self, batch: PackedBatch, split: SequenceSplit, cond: Tensor, token_ids: Tensor | None = None
    ) -> PackInputs:
        """The blocks' inputs for this rank's share of ``batch``; cond [N, h]; token_ids [s_cp]: the
        CP-local token sample ids when the caller has them already."""
        if token_ids is None:
            token_ids = split.local(batch.token_sample_ids())
        inputs = PackInputs(
            cond=cond,
            token_sample_ids=self.layout.sequence_parallel_slice(token_ids),
            self_attention=self.self_attention_params(batch, split),
            padding_mask=self.layout.sequence_parallel_slice(split.local(batch.loss_mask == 0)),
        )
        if self.cross:
            context = self.text_embedder(batch.context.to(cond.dtype)).unsqueeze(1)
            if self.config.sequence_parallel:
                context = tensor_parallel.scatter_to_sequence_parallel_region(context)
            inputs.context, inputs.cross_attention = context, packed_seq_params(batch, True, split)
        if self.model_cfg.pos_embedding == "rope3d":
            inputs.rotary_pos_emb = rope_3d_freqs(
                split.local(batch.pos_ids), self.config.kv_channels, interleaved=self.config.rotary_interleaved
            )
        return inputs

    def self_attention_params(self, batch: PackedBatch, split: SequenceSplit | None = None):
        """Per-sample segments; ST-DiT's factorized attention needs per-frame / per-position ones
        (under CP re-sharded by all-to-all, as frames and positions span the CP ranks)."""
        split = split if split is not None else self.layout.pack_split(batch)
        if self.model_cfg.architecture != "stdit":
            return packed_seq_params(batch, cross=False, split=split)
        host = batch.host_view()
        grids = sample_grids(host.latent_shape, self.model_cfg.patch_temporal, self.model_cfg.patch_spatial)
        params = factorized_params(host.cu_seqlens_q_padded, grids, batch.latents.device)
        if split.size > 1:
            for segments in (params.spatial, params.temporal):
                segments.context_parallel = UlyssesAttention(split, segments)
        return params

    def run_layers(self, hidden: Tensor, inputs: PackInputs) -> Tensor:
        """hidden [s, b, h] through this stage's blocks (recomputed as the config says)."""
        runs = layer_runs(len(self.layers), self.config, self.training)
        return forward_layers(self.layers, runs, hidden, inputs)
