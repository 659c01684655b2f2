"""Model FLOPs of a DiT pack: forward + backward (3x forward), attention included, recompute excluded."""

from __future__ import annotations

from collections.abc import Sequence


def dit_forward_flops(
    model_cfg,
    video_lens: Sequence[int],
    text_lens: Sequence[int],
) -> float:
    """Forward FLOPs (2 per multiply-add) of one pack with the given per-sample token counts."""
    h = model_cfg.hidden_size
    ffn = model_cfg.effective_ffn_hidden_size
    layers = model_cfg.num_layers
    patch_dim = model_cfg.in_channels * model_cfg.patch_temporal * model_cfg.patch_spatial**2
    cross = model_cfg.architecture != "dit_adaln"
    gated = model_cfg.architecture == "moviegen"
    mlp_matmuls = 3 if gated else 2
    topk = model_cfg.moe_router_topk if model_cfg.num_moe_experts else 1
    moe_ffn = model_cfg.moe_ffn_hidden_size or ffn

    per_token_layer = 2 * (4 * h * h + (2 * h * h if cross else 0))  # qkv + proj (+ cross q + proj)
    per_token_layer += 2 * mlp_matmuls * h * (moe_ffn * topk if model_cfg.num_moe_experts else ffn)
    total = 0.0
    for n, m in zip(video_lens, text_lens):
        attn = 2 * 2 * n * n * h + (2 * 2 * n * m * h if cross else 0)
        kv_proj = 2 * 2 * m * h * h if cross else 0
        adaln = 2 * h * 6 * h
        total += layers * (n * per_token_layer + attn + kv_proj + adaln)
        total += 2 * n * patch_dim * h * 2  # patch embed + final linear
        if cross:
            total += 2 * m * (model_cfg.text_embed_dim * h + h * h)
    return total


def dit_training_flops(model_cfg, video_lens: Sequence[int], text_lens: Sequence[int]) -> float:
    return 3.0 * dit_forward_flops(model_cfg, video_lens, text_lens)
