"""Tiny configs, packs and weights shared by the model tests."""

from __future__ import annotations

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from dfm.config.container import ModelConfig
from dfm.data.packing import cumulative, pack_samples
from dfm.data.patchify import patchify
from dfm.data.sample import DiffusionSample
from dfm.models.build import build_model_chunk

IN_CHANNELS, TEXT_DIM = 4, 24

# (architecture, extra ModelConfig fields) for every block family the model supports.
ARCHITECTURES = {
    "dit_adaln": dict(architecture="dit_adaln", num_classes=10, pos_embedding="sincos3d"),
    "dit_cross": dict(architecture="dit_cross", qk_layernorm=True),
    # NeMo's DiT-7B block: low-rank adaLN, a narrower text context, RMSNorm, no linear biases.
    "dit_cross_nemo": dict(
        architecture="dit_cross",
        qk_layernorm=True,
        adaln_lora_dim=8,
        cross_attention_dim=16,
        normalization="rmsnorm",
        add_bias_linear=False,
    ),
    "stdit": dict(architecture="stdit", pos_embedding="rope3d"),
    "moviegen": dict(architecture="moviegen", qk_layernorm=True),
    "moviegen_moe": dict(architecture="moviegen", num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24),
}


def tiny_config(name: str, **overrides) -> ModelConfig:
    fields = dict(
        num_layers=2,
        hidden_size=48,
        num_attention_heads=4,
        in_channels=IN_CHANNELS,
        text_embed_dim=TEXT_DIM,
        max_text_len=16,
        max_latent_thw=[8, 16, 16],
        patch_spatial=2,
        patch_temporal=1,
    )
    return ModelConfig(**{**fields, **ARCHITECTURES[name], **overrides})


def make_sample(index: int, latent_thw: tuple[int, int, int], text_len: int, cfg: ModelConfig) -> DiffusionSample:
    gen = torch.Generator().manual_seed(100 + index)
    latent = torch.randn((cfg.in_channels, *latent_thw), generator=gen)
    tokens, pos_ids = patchify(latent, cfg.patch_temporal, cfg.patch_spatial)
    return DiffusionSample(
        tokens=tokens,
        pos_ids=pos_ids,
        text=torch.randn((text_len, cfg.text_embed_dim), generator=gen),
        latent_shape=tuple(latent.shape),
        sample_index=index,
        metadata={},
    )


# Different (T, H, W) per sample (an image among videos) and different text lengths.
SAMPLE_SHAPES = [((3, 4, 6), 5), ((1, 6, 4), 9), ((2, 4, 4), 3), ((4, 2, 4), 7)]


def make_samples(cfg: ModelConfig) -> list[DiffusionSample]:
    return [make_sample(i, thw, text_len, cfg) for i, (thw, text_len) in enumerate(SAMPLE_SHAPES)]


def randomize_(model: torch.nn.Module, seed: int = 0, std: float = 0.2) -> None:
    """Non-zero weights everywhere (the zero-initialised adaLN / final layer would hide bugs)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            param.copy_(torch.randn(param.shape, generator=gen) * std)


def build_random_model(cfg: ModelConfig, seed: int = 0):
    model, _ = build_model_chunk(cfg, "fp32", seed)
    randomize_(model, seed)
    return model


def conditioning(num_samples: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(num_samples, generator=gen), torch.randint(0, 10, (num_samples,), generator=gen)


__all__ = [
    "ARCHITECTURES",
    "SAMPLE_SHAPES",
    "build_random_model",
    "conditioning",
    "make_samples",
    "pack_samples",
    "randomize_",
    "tiny_config",
]


def segments(q_lens, q_padded, kv_lens, kv_padded, kind: type = PackedSeqParams) -> PackedSeqParams:
    """Host segments of a pack from per-sample real and padded query / key lengths [N]; ``kind``:
    megatron's PackedSeqParams (what the kernels accept) or its PackedSegments subclass."""
    return kind(
        qkv_format="sbhd",
        cu_seqlens_q=cumulative(q_lens),
        cu_seqlens_q_padded=cumulative(q_padded),
        cu_seqlens_kv=cumulative(kv_lens),
        cu_seqlens_kv_padded=cumulative(kv_padded),
    )


def segments_on(device, q_lens, q_padded, kv_lens, kv_padded) -> PackedSeqParams:
    """``segments`` with its boundaries on ``device`` and a host copy in ``params.host``, as a pack
    moved to the device has them (kernels read their host-side bounds from it: no device sync)."""
    params = segments(q_lens, q_padded, kv_lens, kv_padded)
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        setattr(params, name, getattr(params, name).to(device))
    params.host = segments(q_lens, q_padded, kv_lens, kv_padded)
    return params
