"""One encoded training sample, before packing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class DiffusionSample:
    tokens: torch.Tensor  # [L, pt*ph*pw*C] patchified latent
    pos_ids: torch.Tensor  # [L, 3] long (t, h, w) patch coordinates
    text: torch.Tensor  # [L_kv, D_text] unpadded text embedding
    latent_shape: tuple[int, int, int, int]  # (C, T, H, W) of the latent before patchify
    sample_index: int  # global index in the data stream
    metadata: dict[str, Any] = field(default_factory=dict)
    pooled_text: torch.Tensor | None = None  # [D_pool] pooled text vector (FLUX); None: none
    # HunyuanVideo 1.5 (see PackedBatch): per-token condition features, the ByT5 text, image embeddings.
    condition: torch.Tensor | None = None  # [L, D_cond]
    text_2: torch.Tensor | None = None  # [L_kv2, D_text2] unpadded
    image_embeds: torch.Tensor | None = None  # [L_img, D_img]; all zero: none (text-to-video)
    # Image-to-video by a clean first frame (Wan 2.2 TI2V): its tokens are given at t = 0, not trained.
    first_frame_clean: bool = False
    # Wan 2.2 I2V-A14B: per-token mask + image-condition latent (dfm/data/video_condition.py); None: none.
    image_condition: torch.Tensor | None = None  # [L, pt*ph*pw*(4 + C)]

    @property
    def seq_len_q(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_len_kv(self) -> int:
        return int(self.text.shape[0])
