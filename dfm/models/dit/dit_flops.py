"""DiT-family forward FLOPs of a pack (dfm/models/flops.py sums them for training).

2 FLOPs per multiply-add, real tokens only (padding is not useful work). Counted per
architecture from the same pieces the model is built of; a test checks the total against
``torch.utils.flop_counter`` on a small instance.
"""

from __future__ import annotations

from collections.abc import Sequence

TIMESTEP_FREQUENCY_DIM = 256  # dfm.models.common.embeddings.TimestepEmbedder


def mlp_flops_per_token(model_cfg) -> float:
    """Dense MLP (GELU: 2 matmuls, SwiGLU: 3) or MoE (router + top-k SwiGLU experts)."""
    h = model_cfg.hidden_size
    matmuls = 3 if model_cfg.architecture == "moviegen" else 2
    if not model_cfg.num_moe_experts:
        return 2 * matmuls * h * model_cfg.effective_ffn_hidden_size
    expert_ffn = model_cfg.moe_ffn_hidden_size or model_cfg.effective_ffn_hidden_size
    return 2 * h * model_cfg.num_moe_experts + model_cfg.moe_router_topk * 2 * matmuls * h * expert_ffn


def self_attention_flops(h: int, tokens: int, segment_len: int) -> float:
    """qkv + out projections over ``tokens``, plus QK^T and AV within segments of ``segment_len``."""
    return 8 * tokens * h * h + 4 * tokens * segment_len * h


def layer_flops(model_cfg, n: int, m: int, frames: int) -> float:
    """One block on one sample of n video tokens (in ``frames`` frames) and m text tokens."""
    h = model_cfg.hidden_size
    arch = model_cfg.architecture
    if arch == "stdit":
        attention = self_attention_flops(h, n, n // frames) + self_attention_flops(h, n, frames)
        modulations = 9
    else:
        attention = self_attention_flops(h, n, n)
        modulations = 6
    c = model_cfg.context_width
    cross = 0 if arch == "dit_adaln" else 4 * n * h * h + 4 * m * c * h + 4 * n * m * h
    return attention + cross + n * mlp_flops_per_token(model_cfg) + modulation_flops(model_cfg, modulations)


def modulation_flops(model_cfg, chunks: int) -> float:
    """The adaLN projection of one sample: h -> chunks x h, or h -> rank -> chunks x h (low rank)."""
    h, rank = model_cfg.hidden_size, model_cfg.adaln_lora_dim
    return 2 * h * chunks * h if not rank else 2 * rank * h * (1 + chunks)


def embedding_flops(model_cfg, n: int, m: int) -> float:
    """Patch embedding, final layer, timestep MLP and text MLP for one sample."""
    h = model_cfg.hidden_size
    patch_volume = model_cfg.patch_temporal * model_cfg.patch_spatial**2
    patch_in = model_cfg.in_channels * patch_volume
    patch_out = (model_cfg.out_channels or model_cfg.in_channels) * patch_volume
    total = 2 * n * h * (patch_in + patch_out) + 2 * h * 2 * h + 2 * (TIMESTEP_FREQUENCY_DIM * h + h * h)
    if model_cfg.architecture != "dit_adaln":
        c = model_cfg.context_width
        total += 2 * m * (model_cfg.text_embed_dim * c + c * c)
    return total


def dit_forward_flops(
    model_cfg, video_lens: Sequence[int], text_lens: Sequence[int], frames: Sequence[int] | None = None
) -> float:
    """Forward FLOPs of one pack. ``frames``: per-sample token-grid T (ST-DiT needs it; default 1)."""
    frames = frames if frames is not None else [1] * len(video_lens)
    return sum(
        model_cfg.num_layers * layer_flops(model_cfg, n, m, t) + embedding_flops(model_cfg, n, m)
        for n, m, t in zip(video_lens, text_lens, frames)
    )
