"""A tiny random diffusers Wan 2.1 T2V transformer and its dfm config, built by the tests."""

from __future__ import annotations

import torch

from dfm.config.container import ModelConfig
from dfm.convert.wan import model_overrides

TEXT_LEN = 8  # text padded per sample, as WanPipeline pads to 512
TINY = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=4,
    attention_head_dim=12,
    in_channels=4,
    out_channels=4,
    text_dim=24,
    freq_dim=256,
    ffn_dim=64,
    num_layers=2,
)


def tiny_diffusers_wan(seed: int = 0, std: float = 0.1):
    """WanTransformer3DModel with every parameter N(0, std^2) (zero or one inits would hide bugs), fp32."""
    import diffusers

    torch.manual_seed(seed)
    transformer = diffusers.WanTransformer3DModel(**TINY).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(transformer.named_parameters()):
            param.copy_(torch.randn(param.shape, generator=gen) * std)
    return transformer


def tiny_model_config(**overrides) -> ModelConfig:
    fields = {
        key.split(".", 1)[1]: value for key, value in model_overrides(dict(TINY)).items() if key.startswith("model.")
    }
    return ModelConfig(
        **{**fields, "architecture": "wan", "max_text_len": TEXT_LEN, "attention_backend": "sdpa", **overrides}
    )
