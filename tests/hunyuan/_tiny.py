"""A tiny random diffusers HunyuanVideo 1.5 transformer and its dfm config and weights."""

from __future__ import annotations

import diffusers
import torch

from dfm.convert.cli import import_config
from dfm.convert.hunyuan import HUNYUAN, hunyuan_rules
from dfm.convert.rules import to_dfm

TINY = dict(
    in_channels=9,  # 4 latent channels, 4 condition channels, 1 mask
    out_channels=4,
    num_attention_heads=2,
    attention_head_dim=16,
    num_layers=2,
    num_refiner_layers=2,
    text_embed_dim=24,
    text_embed_2_dim=20,
    image_embed_dim=12,
    rope_axes_dim=(4, 6, 6),
)


def tiny_diffusers_hunyuan(seed: int = 0, std: float = 0.1) -> diffusers.HunyuanVideo15Transformer3DModel:
    """Random weights everywhere (norm weights around 1 would hide a swapped scale; draw them too)."""
    torch.manual_seed(seed)
    model = diffusers.HunyuanVideo15Transformer3DModel(**TINY).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            param.copy_(
                torch.randn(param.shape, generator=generator) * std + (1.0 if param.dim() == 1 and "norm" in _ else 0.0)
            )
    return model


def dfm_config_and_weights(reference):
    """(validated ConfigContainer, {global name: tensor}) of ``reference`` as the import makes them."""
    cfg = import_config(HUNYUAN, dict(reference.config), None, ["model.attention_backend=sdpa"])
    return cfg, to_dfm(reference.state_dict(), hunyuan_rules(cfg.model))


# (latent (T, H, W), Qwen tokens, ByT5 tokens) of the tiny training clips; ByT5 0: a caption without quoted text.
TRAIN_CLIPS = (((2, 4, 6), 5, 3), ((3, 4, 4), 7, 0), ((1, 6, 4), 4, 2), ((2, 4, 4), 6, 1))


def write_hunyuan_shards(folder, model, image_tokens: int = 5):
    """An energon dataset of ``TRAIN_CLIPS`` in HunyuanVideo 1.5's shard layout (random parts of the
    model's widths), indexed by the real ``energon prepare``."""
    from dfm.data.prepare.energon_prepare import run_energon_prepare
    from dfm.data.prepare.shards import BYT5_PART, FIRST_FRAME_PART, IMAGE_PART, AtomicShardWriter, encode_sample_parts

    gen = torch.Generator().manual_seed(0)
    with AtomicShardWriter(folder, "rank000", maxcount=100) as writer:
        for index, ((t, h, w), qwen, byt5) in enumerate(TRAIN_CLIPS):
            latent = torch.randn(model.in_channels, t, h, w, generator=gen)
            extra = {
                BYT5_PART: torch.randn(byt5, model.text_embed_2_dim, generator=gen),
                FIRST_FRAME_PART: latent[:, :1] + 0.1 * torch.randn(model.in_channels, 1, h, w, generator=gen),
                IMAGE_PART: torch.randn(image_tokens, model.image_embed_dim, generator=gen),
            }
            text = torch.randn(qwen, model.text_embed_dim, generator=gen)
            writer.write(encode_sample_parts(f"{index:08d}", latent, text, {"caption": f"clip {index}"}, None, extra))
    run_energon_prepare(folder)
    return folder
