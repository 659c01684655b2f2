"""FLUX forward FLOPs of a pack (2 per multiply-add, real tokens only), as dfm/models/dit/dit_flops.py
counts the DiT family: each sample's joint sequence of L = n image + m text tokens."""

from __future__ import annotations

from collections.abc import Sequence

FREQUENCY_DIM = 256  # the timestep / guidance sinusoid (dfm.models.common.embeddings.TimestepEmbedder)


def double_block_flops(h: int, ffn: int, length: int) -> float:
    """Per stream q/k/v, out projection and MLP on its tokens (together: all L), joint attention, 2 adaLNs."""
    return length * (8 * h * h + 4 * h * ffn) + 4 * length * length * h + 2 * 2 * h * 6 * h


def single_block_flops(h: int, ffn: int, length: int) -> float:
    """q/k/v, proj_mlp, proj_out over cat(attention, MLP), joint attention, one adaLN."""
    return length * (6 * h * h + 2 * h * ffn + 2 * (h + ffn) * h) + 4 * length * length * h + 2 * h * 3 * h


def embedding_flops(model_cfg, n: int, m: int) -> float:
    """Patch and text embedders, final layer, timestep (+ guidance) and pooled-text MLPs for one sample."""
    h = model_cfg.hidden_size
    patch = model_cfg.in_channels * model_cfg.patch_temporal * model_cfg.patch_spatial**2
    per_sample_mlps = (2 if model_cfg.guidance_embeds else 1) * (FREQUENCY_DIM * h + h * h)
    per_sample_mlps += model_cfg.pooled_text_dim * h + h * h + h * 2 * h
    return 2 * (2 * n * patch * h + m * model_cfg.text_embed_dim * h + per_sample_mlps)


def flux_forward_flops(
    model_cfg, image_lens: Sequence[int], text_lens: Sequence[int], frames: Sequence[int] | None = None
) -> float:
    """Forward FLOPs of one pack of samples with ``image_lens`` image and ``text_lens`` text tokens
    (images: ``frames`` is not read)."""
    h, ffn = model_cfg.hidden_size, model_cfg.effective_ffn_hidden_size
    single = model_cfg.num_single_layers
    double = model_cfg.num_layers - single
    return sum(
        double * double_block_flops(h, ffn, n + m)
        + single * single_block_flops(h, ffn, n + m)
        + embedding_flops(model_cfg, n, m)
        for n, m in zip(image_lens, text_lens)
    )
