"""Published model shapes, by name. Each entry is a set of ``ModelConfig`` fields;
``dfm.config.recipes`` turns every entry into a recipe of the same name (``recipe: DiT-XL/2``).
"""

from __future__ import annotations

from types import MappingProxyType

# facebookresearch/DiT: class-conditional ImageNet 256x256 -> 32x32x4 SD-VAE latents,
# fixed sin-cos positions, learned-sigma head (2x output channels), a null class for CFG.
_DIT_IMAGENET = dict(
    architecture="dit_adaln",
    patch_spatial=2,
    patch_temporal=1,
    in_channels=4,
    out_channels=8,
    num_classes=1000,
    pos_embedding="sincos3d",
    max_latent_thw=[1, 32, 32],
)
# NVIDIA's video DiT configs: text cross-attention (T5-XXL, 4096-d), 3D RoPE, QK RMSNorm.
_VIDEO = dict(
    patch_spatial=2,
    patch_temporal=1,
    in_channels=16,
    text_embed_dim=4096,
    max_text_len=512,
    pos_embedding="rope3d",
    qk_layernorm=True,
)

# Black Forest Labs FLUX.1 (diffusers FluxTransformer2DModel): 19 double-stream + 38 single-stream
# blocks, 16-channel latents in 2x2 patches, T5-XXL tokens + a pooled CLIP-L vector, flow matching.
_FLUX1 = dict(
    architecture="flux",
    num_single_layers=38,
    ffn_hidden_size=12288,
    patch_spatial=2,
    patch_temporal=1,
    in_channels=16,
    text_embed_dim=4096,
    pooled_text_dim=768,
    rope_axes_dim=[16, 56, 56],
    qk_layernorm=True,
    pipeline="flow",
)


def _shape(layers: int, hidden: int, heads: int, **extra) -> dict:
    return dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, **extra)


PRESETS = MappingProxyType(
    {
        "DiT-S/2": _shape(12, 384, 6, **_DIT_IMAGENET),
        "DiT-B/2": _shape(12, 768, 12, **_DIT_IMAGENET),
        "DiT-L/2": _shape(24, 1024, 16, **_DIT_IMAGENET),
        "DiT-XL/2": _shape(28, 1152, 16, **_DIT_IMAGENET),
        "DiT-7B": _shape(32, 4096, 32, architecture="dit_cross", **_VIDEO),
        "DiT-28B": _shape(48, 6144, 48, architecture="dit_cross", **_VIDEO),
        # Open-Sora 1.0 STDiT-XL/2: SD-VAE latents, T5 captions of 120 tokens, sin-cos positions.
        "STDiT-XL/2": _shape(
            28,
            1152,
            16,
            architecture="stdit",
            patch_spatial=2,
            patch_temporal=1,
            in_channels=4,
            out_channels=8,
            text_embed_dim=4096,
            max_text_len=120,
            pos_embedding="sincos3d",
        ),
        "STDiT-30B": _shape(28, 6144, 48, architecture="stdit", **_VIDEO),
        # MovieGen Video (Polyak et al. 2024), 30B: Llama-style blocks, 48 x 6144, 48 heads, FFN 16384.
        "MovieGen-30B": _shape(48, 6144, 48, architecture="moviegen", ffn_hidden_size=16384, **_VIDEO),
        # FLUX.1-dev is guidance-distilled (a guidance embedder); FLUX.1-schnell is timestep-distilled.
        "FLUX.1-dev": _shape(57, 3072, 24, guidance_embeds=True, max_text_len=512, **_FLUX1),
        "FLUX.1-schnell": _shape(57, 3072, 24, guidance_embeds=False, max_text_len=256, **_FLUX1),
    }
)


def preset_names() -> list[str]:
    return list(PRESETS)
