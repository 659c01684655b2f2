"""A tiny random diffusers HunyuanVideo 1.5 transformer and its dfm config and weights."""

from __future__ import annotations

import diffusers

from dfm.convert.hunyuan import HUNYUAN, hunyuan_rules
from dfm.convert.import_export import import_config
from dfm.convert.rules import to_dfm
from tests._parity import random_model

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
    return random_model(lambda: diffusers.HunyuanVideo15Transformer3DModel(**TINY), seed, std, norm_around_one)


def norm_around_one(name: str, param) -> float:
    return 1.0 if param.dim() == 1 and "norm" in name else 0.0


def dfm_config_and_weights(reference):
    """(validated ConfigContainer, {global name: tensor}) of ``reference`` as the import makes them."""
    cfg = import_config(HUNYUAN, dict(reference.config), None, ["model.attention_backend=sdpa"])
    return cfg, to_dfm(reference.state_dict(), hunyuan_rules(cfg.model))


# Captions of the tiny clips: the first has quoted text (ByT5 glyph tokens), the second none.
CAPTIONS = {"bars": 'a sign saying "OPEN" slides left', "dots": "a dot moving up"}


def prepare_with_hunyuan_encoders(tmp_path):
    """Energon shards of two tiny captioned clips (5 frames, 32 x 48) through prepare_energon_dataset.py
    with the tiny HunyuanVideo 1.5 encoders (``--encoders hunyuan_video15``) and the real ``energon prepare``."""
    import json

    from tests.training.entry import prepare_shards
    from tests.wan._tiny import write_tiny_videos

    write_tiny_videos(tmp_path / "videos")
    for name, caption in CAPTIONS.items():
        (tmp_path / "videos" / f"{name}.json").write_text(json.dumps({"caption": caption}))
    flags = ["--height", 32, "--width", 48, "--num_frames", 5, "--patch_spatial", 1, "--caption_format", "sidecar"]
    return prepare_shards(
        tmp_path / "videos", tmp_path / "shards", *flags, "--encoders", "hunyuan_video15", "--tiny_random_encoders"
    )
