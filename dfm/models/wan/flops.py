"""Wan forward FLOPs of a pack: the DiT count (dfm/models/dit/dit_flops.py) with each sample's text
padded to ``model.max_text_len``, which Wan's cross-attention attends to, and the patch embedding
reading the image condition's channels too (I2V)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from dfm.data.video_condition import wan_condition_channels
from dfm.models.dit.dit_flops import dit_forward_flops


def wan_forward_flops(
    model_cfg, video_lens: Sequence[int], text_lens: Sequence[int], frames: Sequence[int] | None = None
) -> float:
    out_channels = model_cfg.out_channels or model_cfg.in_channels
    reads = dataclasses.replace(
        model_cfg, in_channels=model_cfg.in_channels + wan_condition_channels(model_cfg), out_channels=out_channels
    )
    return dit_forward_flops(reads, video_lens, [model_cfg.max_text_len] * len(video_lens), frames)
