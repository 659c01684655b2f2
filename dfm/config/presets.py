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
_NEMO_VIDEO = dict(_VIDEO, cross_attention_dim=1024, normalization="rmsnorm", add_bias_linear=False, adaln_lora_dim=256)

# What FLUX.1 and Wan 2.1 share: 16-channel VAE latents in 1x2x2 patches, 4096-wide (T5 / UMT5) text,
# q/k RMSNorm, flow matching.
_FLOW_16_CHANNELS = dict(
    patch_spatial=2, patch_temporal=1, in_channels=16, text_embed_dim=4096, qk_layernorm=True, pipeline="flow"
)

# Black Forest Labs FLUX.1 (diffusers FluxTransformer2DModel): 19 double-stream + 38 single-stream
# blocks, 16-channel latents in 2x2 patches, T5-XXL tokens + a pooled CLIP-L vector, flow matching.
_FLUX1 = dict(
    architecture="flux",
    num_single_layers=38,
    ffn_hidden_size=12288,
    pooled_text_dim=768,
    rope_axes_dim=[16, 56, 56],
    **_FLOW_16_CHANNELS,
)


# Wan 2.1 text-to-video (Wan-AI/Wan2.1-T2V-*-Diffusers): UMT5 text (4096-d, 512 tokens), 3D RoPE on
# interleaved pairs, q/k RMSNorm across heads; flow matching on the timestep 1000 t.
_WAN = dict(architecture="wan", max_text_len=512, pos_embedding="rope3d", **_FLOW_16_CHANNELS)


# Tencent HunyuanVideo 1.5 (diffusers HunyuanVideo15Transformer3DModel): 54 dual-stream blocks of 16 x 128,
# 32-channel latents in 1x1x1 patches (+ 32 condition channels and a mask), Qwen2.5-VL text (3584) through
# a 2-block refiner, ByT5 glyph text (1472), SigLIP image tokens (1152); RoPE base 256 on (t, h, w).
# The T2V and I2V checkpoints share the shape.
_HUNYUAN15 = dict(
    architecture="hunyuan_video15",
    ffn_hidden_size=8192,
    in_channels=32,
    out_channels=32,
    patch_spatial=1,
    patch_temporal=1,
    text_embed_dim=3584,
    text_embed_2_dim=1472,
    image_embed_dim=1152,
    max_text_len=1000,
    rope_axes_dim=[16, 56, 56],
    rope_theta=256.0,
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
        # NeMo's DiT7BConfig (Cosmos-1 7B): 28 x 4096, 32 heads, a 1024-wide text context, RMSNorm, no
        # linear biases, per-head q/k norm, low-rank (256) adaLN. DiT-28B: the same block at 50 x 6144, 48
        # heads, ~28B parameters and the 186 GFLOP per token at 8k that NeMo's 28B table row implies.
        "DiT-7B": _shape(28, 4096, 32, architecture="dit_cross", **_NEMO_VIDEO),
        "DiT-28B": _shape(50, 6144, 48, architecture="dit_cross", **_NEMO_VIDEO),
        # Full-width adaLN and a hidden-wide text context: the shapes dfm called DiT-7B and DiT-28B
        # before, named by their size.
        "DiT-12B": _shape(32, 4096, 32, architecture="dit_cross", **_VIDEO),
        "DiT-40B": _shape(48, 6144, 48, architecture="dit_cross", **_VIDEO),
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
        "Wan2.1-T2V-1.3B": _shape(30, 1536, 12, ffn_hidden_size=8960, **_WAN),
        "Wan2.1-T2V-14B": _shape(40, 5120, 40, ffn_hidden_size=13824, **_WAN),
        "HunyuanVideo-1.5-T2V-720p": _shape(54, 2048, 16, **_HUNYUAN15),
        "HunyuanVideo-1.5-I2V-720p": _shape(54, 2048, 16, **_HUNYUAN15),
        # Wan 2.2 (docs/wan.md): TI2V-5B reads the 48-channel Wan 2.2 VAE's latents.
        "Wan2.2-TI2V-5B": _shape(30, 3072, 24, ffn_hidden_size=14336, **{**_WAN, "in_channels": 48}),
        # A14B: two experts of Wan2.1-T2V-14B's shape split at the boundary (pick one: model.wan_expert).
        # I2V reads 36 channels (16 noisy latent + 4 mask + 16 image latent: wan_image_condition), predicts 16.
        "Wan2.2-T2V-A14B": _shape(40, 5120, 40, ffn_hidden_size=13824, wan_boundary_ratio=0.875, **_WAN),
        "Wan2.2-I2V-A14B": _shape(
            40,
            5120,
            40,
            ffn_hidden_size=13824,
            wan_boundary_ratio=0.9,
            wan_image_condition=True,
            **_WAN,
        ),
    }
)

# What a preset's recipe sets beyond the model: {section: {field: value}}. Wan embeds the timestep
# 1000 t and samples with shift 5 (Wan's generate.py default for text-to-video).
_WAN_SETTINGS = {"flow": {"c_noise_scale": 1000.0, "shift": 5.0}}
# HunyuanVideo 1.5 embeds 1000 t too; fine-tuning draws t logit-normal, shifted by 3.
_HUNYUAN15_SETTINGS = {"flow": {"c_noise_scale": 1000.0, "shift": 3.0}}
PRESET_SETTINGS = MappingProxyType(
    {
        "Wan2.1-T2V-1.3B": _WAN_SETTINGS,
        "Wan2.1-T2V-14B": _WAN_SETTINGS,
        "Wan2.2-TI2V-5B": _WAN_SETTINGS,
        "HunyuanVideo-1.5-T2V-720p": _HUNYUAN15_SETTINGS,
        "HunyuanVideo-1.5-I2V-720p": _HUNYUAN15_SETTINGS,
        # Wan 2.2's generate.py: sample_shift 12 for T2V-A14B, 5 for I2V-A14B.
        "Wan2.2-T2V-A14B": {"flow": {"c_noise_scale": 1000.0, "shift": 12.0}},
        "Wan2.2-I2V-A14B": _WAN_SETTINGS,
    }
)


def preset_names() -> list[str]:
    return list(PRESETS)
