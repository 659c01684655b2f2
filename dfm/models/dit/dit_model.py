"""DiT on the packed scaffold (dfm/models/common/packed_model.py): patch embed -> DiT blocks
(dit_spec.py) -> adaLN final layer. Serves dit_adaln (class-conditioned), dit_cross (text
cross-attention), stdit (factorized spatial / temporal attention) and moviegen (Llama-style blocks).

The timestep, class and text embedders live on every pipeline stage, the patch embedding on the
first, the final layer on the last.
"""

from __future__ import annotations

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor, nn

from dfm.data.packed_batch import PackedBatch
from dfm.models.attention.context_parallel import UlyssesAttention, local_query_attention
from dfm.models.attention.rope_tables import RotaryTables
from dfm.models.attention.segments import PackedSegments
from dfm.models.common.embeddings import (
    FactorizedLearned3DEmbedding,
    SincosTable,
    TimestepEmbedder,
    rope_3d_freqs,
    sincos_3d,
)
from dfm.models.common.factorized_layout import factorized_params, sample_grids
from dfm.models.common.final_layer import FinalLayer
from dfm.models.common.pack_inputs import PackInputs
from dfm.models.common.packed_model import PackedDiffusionModel
from dfm.models.common.row_modulation import RowLayout, row_layout
from dfm.models.dit.dit_layer import block_norm
from dfm.parallel.sequence_split import SequenceSplit


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


class DiTModel(PackedDiffusionModel):
    """Packed DiT: (x_in [S, D], c_noise [N], batch, class labels [N] | None) -> raw prediction [S, D]."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sincos_table = SincosTable()  # not a module: no parameters, nothing saved

    @property
    def cross(self) -> bool:
        """Text-conditioned (cross-attention) blocks."""
        return self.model_cfg.architecture != "dit_adaln"

    @property
    def out_dim(self) -> int:
        """DiT's learned-sigma head predicts 2x channels; forward returns the first patch_dim (the mean)."""
        cfg = self.model_cfg
        return (cfg.out_channels or cfg.in_channels) * cfg.patch_temporal * cfg.patch_spatial**2

    def build_conditioning(self) -> dict[str, nn.Module | None]:
        cfg, h = self.model_cfg, self.config.hidden_size
        modules = {"t_embedder": TimestepEmbedder(h)}
        if self.cross:
            modules["text_embedder"] = TextEmbedder(cfg.text_embed_dim, cfg.context_width)
        if cfg.num_classes:
            # One extra row is the null class for classifier-free guidance.
            modules["class_embedder"] = nn.Embedding(cfg.num_classes + 1, h)
        return modules

    def build_embedding(self) -> dict[str, nn.Module]:
        cfg, h = self.model_cfg, self.config.hidden_size
        modules = {"x_embedder": nn.Linear(self.patch_dim, h)}
        if cfg.pos_embedding == "learned3d":
            modules["pos_embedder"] = FactorizedLearned3DEmbedding(tuple(cfg.max_latent_thw), h)
        return modules

    def build_head(self, layer_spec) -> nn.Module:
        norm = block_norm(self.config, layer_spec.submodules.norm)
        return FinalLayer(self.config.hidden_size, self.out_dim, self.config.layernorm_epsilon, norm)

    def condition(self, noise_level: Tensor, batch: PackedBatch, extra: Tensor | None) -> Tensor:
        return self.conditioning(noise_level, extra)

    def conditioning(self, c_noise: Tensor, class_labels: Tensor | None) -> Tensor:
        """[N] noise levels (+ [N] labels; None: the null class) -> [N, h]."""
        cond = self.t_embedder(c_noise)
        if self.model_cfg.num_classes:
            if class_labels is None:
                class_labels = torch.full_like(c_noise, self.model_cfg.num_classes, dtype=torch.long)
            cond = cond + self.class_embedder(class_labels)
        return cond

    def embed(self, x_local: Tensor, batch: PackedBatch, split: SequenceSplit) -> Tensor:
        host_pos_ids = batch.host_view().pos_ids if split.size == 1 else None
        return self.scatter_sequence(self.embed_patches(x_local, split.local(batch.pos_ids), host_pos_ids))

    def embed_patches(self, x_in: Tensor, pos_ids: Tensor, host_pos_ids: Tensor | None = None) -> Tensor:
        """[S, D] -> [S, 1, h] with absolute positions added when configured; ``host_pos_ids``: the host
        copy of pos_ids [S, 3], given when the sincos table may be kept for the next pack."""
        hidden = self.x_embedder(x_in.to(self.x_embedder.weight.dtype))
        if self.model_cfg.pos_embedding == "sincos3d":
            if host_pos_ids is None:
                table = sincos_3d(pos_ids, hidden.shape[-1])
            else:
                table = self.sincos_table(pos_ids, host_pos_ids, hidden.shape[-1])
            hidden = hidden + table.to(hidden.dtype)
        elif self.model_cfg.pos_embedding == "learned3d":
            hidden = hidden + self.pos_embedder(pos_ids)
        return hidden.unsqueeze(1)

    def head_output(self, hidden: Tensor, inputs: PackInputs, token_ids: Tensor) -> Tensor:
        hidden = self.latent_hidden(hidden, inputs)
        return self.final_layer(hidden, inputs.cond, token_ids, inputs.tokens_per_sample)[:, 0, : self.patch_dim]

    def pack_inputs(
        self, batch: PackedBatch, split: SequenceSplit, cond: Tensor, token_ids: Tensor | None = None
    ) -> PackInputs:
        """The blocks' inputs for this rank's share of ``batch``; cond [N, h]."""
        if token_ids is None:
            token_ids = split.local(self.conditioning_rows(batch))
        inputs = PackInputs(
            cond=cond,
            token_sample_ids=self.layout.sequence_parallel_slice(token_ids),
            self_attention=self.self_attention_params(batch, split),
            padding_mask=self.layout.sequence_parallel_slice(split.local(batch.loss_mask == 0)),
            tokens_per_sample=self.tokens_per_sample(batch, split),
        )
        if self.cross:
            context = self.text_embedder(batch.context.to(cond.dtype)).unsqueeze(1)
            inputs.context, inputs.cross_attention = (
                self.scatter_sequence(context),
                packed_seq_params(batch, True, split),
            )
        if self.model_cfg.pos_embedding == "rope3d":
            angles = rope_3d_freqs(
                split.local(batch.pos_ids), self.config.kv_channels, interleaved=self.config.rotary_interleaved
            )
            inputs.rotary_pos_emb = self.rotary_inputs(angles)
        return inputs

    def tokens_per_sample(self, batch: PackedBatch, split: SequenceSplit) -> RowLayout:
        """How this rank's tokens lie by sample (``row_modulation.RowLayout``) when it holds the whole pack:
        L for N samples of L tokens each (padding included) in order, runs of samples of one length each
        for a pack grouped by length; else 0, gathered (read from the host copy: no device sync)."""
        if split.size > 1 or self.config.sequence_parallel:
            return 0
        lengths = batch.host_view().padded_sample_lengths.tolist()
        return row_layout(lengths, batch.seq_len, self.config.hidden_size)

    def rotary_inputs(self, angles: Tensor) -> RotaryTables | Tensor:
        """The blocks' RoPE input from the angles [s, 1, 1, d]: cos / sin tables made once for the pack and
        shared by every layer (LeanSelfAttention reads them, rope_tables.py)."""
        return RotaryTables(angles, self.config.rotary_interleaved)

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
