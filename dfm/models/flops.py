"""Model FLOPs of a pack, any family: forward + backward (3x forward), attention included,
recompute excluded; 2 FLOPs per multiply-add, real tokens only. Each family counts its forward
(dfm/models/<family>/flops.py); a test checks them against ``torch.utils.flop_counter``."""

from __future__ import annotations

from collections.abc import Sequence

from dfm.models.registry import family_of


def forward_flops(
    model_cfg, video_lens: Sequence[int], text_lens: Sequence[int], frames: Sequence[int] | None = None
) -> float:
    """Forward FLOPs of one pack. ``frames``: per-sample token-grid T (ST-DiT needs it; default 1)."""
    return family_of(model_cfg).forward_flops(model_cfg, video_lens, text_lens, frames)


def training_flops(
    model_cfg, video_lens: Sequence[int], text_lens: Sequence[int], frames: Sequence[int] | None = None
) -> float:
    """Forward + backward FLOPs of one pack (backward = 2x forward)."""
    return 3.0 * forward_flops(model_cfg, video_lens, text_lens, frames)
