"""The packed micro-batch: the one contract between data, pipelines and models.

Several samples (images are T=1 videos) are concatenated along the sequence (THD layout).
Sample i occupies tokens ``[cu_seqlens_q_padded[i], cu_seqlens_q_padded[i] + seqlens_q[i])``;
the rest of its padded segment is padding (loss_mask 0, attends to nothing, output ignored).
Text is laid out the same way with the ``*_kv`` fields. No token attends across samples.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class PackedBatch:
    latents: torch.Tensor  # [S, C*pt*ph*pw] clean patchified latents
    context: torch.Tensor  # [S_kv, D_text] text embeddings
    cu_seqlens_q: torch.Tensor  # [N+1] int32, cumulative real video-token lengths
    cu_seqlens_q_padded: torch.Tensor  # [N+1] int32, segment offsets incl. padding; [-1] == S
    cu_seqlens_kv: torch.Tensor  # [N+1] int32, cumulative real text lengths
    cu_seqlens_kv_padded: torch.Tensor  # [N+1] int32; [-1] == S_kv
    pos_ids: torch.Tensor  # [S, 3] long, (t, h, w) patch coordinates within its sample
    loss_mask: torch.Tensor  # [S] float, 1 on real tokens
    latent_shape: torch.Tensor  # [N, 4] long, (C, T, H, W) of each sample's latent
    sample_index: torch.Tensor  # [N] long, global sample index (seeds noise, proves layout independence)

    @property
    def num_samples(self) -> int:
        return int(self.latent_shape.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.latents.shape[0])

    def num_real_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def token_sample_ids(self) -> torch.Tensor:
        """[S] long: which sample each token (padding included) belongs to."""
        lengths = (self.cu_seqlens_q_padded[1:] - self.cu_seqlens_q_padded[:-1]).long()
        return torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)

    def to(self, device: torch.device | str) -> "PackedBatch":
        return PackedBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})
