"""Image-to-video by a clean first frame (Wan 2.2 TI2V; diffusers' ``expand_timesteps``).

A flagged sample's first latent frame is the condition: its tokens enter the model clean, at
timestep 0, and the loss leaves them out. Its other tokens, and every token of an unflagged
(text-to-video) sample in the same pack, are noised at the sample's t as usual.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from dfm.data.packed_batch import PackedBatch


def first_frame_tokens(batch: PackedBatch) -> Tensor | None:
    """[S] bool: the tokens of flagged samples' first frame (temporal patch 0); None: no flagged sample.
    Device ops only (no host sync)."""
    if batch.first_frame_clean is None:
        return None
    return batch.first_frame_clean[batch.token_sample_ids()] & (batch.pos_ids[:, 0] == 0)


def keep_first_frames_clean(x_in: Tensor, batch: PackedBatch) -> tuple[Tensor, PackedBatch]:
    """(x_in [S, D] with the condition tokens' clean latents, ``batch`` with them out of its loss mask)."""
    clean = first_frame_tokens(batch)
    if clean is None:
        return x_in, batch
    x_in = torch.where(clean[:, None], batch.latents.to(x_in.dtype), x_in)
    loss_mask = torch.where(clean, torch.zeros_like(batch.loss_mask), batch.loss_mask)
    return x_in, dataclasses.replace(batch, loss_mask=loss_mask)
