"""HunyuanVideo 1.5 forward FLOPs of a pack (2 per multiply-add, real tokens only): FLUX's
double-stream block over each sample's joint sequence of n video + m text tokens, plus the video
embedder and head. The text-side embedders (refiner, ByT5, SigLIP projections) are left out: they
run once per text token, not per block."""

from __future__ import annotations

from collections.abc import Sequence

from dfm.models.flux.flops import double_block_flops


def hunyuan_forward_flops(
    model_cfg, video_lens: Sequence[int], text_lens: Sequence[int], frames: Sequence[int] | None = None
) -> float:
    h, ffn, c = model_cfg.hidden_size, model_cfg.effective_ffn_hidden_size, model_cfg.in_channels
    return sum(
        model_cfg.num_layers * double_block_flops(h, ffn, n + m) + 2 * n * h * ((2 * c + 1) + c)
        for n, m in zip(video_lens, text_lens)
    )
