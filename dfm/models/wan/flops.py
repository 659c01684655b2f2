"""Wan forward FLOPs of a pack: the DiT count (dfm/models/dit/dit_flops.py) with each sample's text
padded to ``model.max_text_len``, which Wan's cross-attention attends to."""

from __future__ import annotations

from collections.abc import Sequence

from dfm.models.dit.dit_flops import dit_forward_flops


def wan_forward_flops(
    model_cfg, video_lens: Sequence[int], text_lens: Sequence[int], frames: Sequence[int] | None = None
) -> float:
    return dit_forward_flops(model_cfg, video_lens, [model_cfg.max_text_len] * len(video_lens), frames)
