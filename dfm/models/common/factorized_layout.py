"""Segments for factorized (ST-DiT) attention over a THD pack.

Spatial attention: one segment per frame (the H*W tokens of one t), in token order.
Temporal attention: one segment per (h, w) position (its T tokens); the attention gathers q/k/v
into (h, w, t) order per sample so each segment is contiguous, and scatters its output back
(``PackedSegments.token_order``): the permutation happens where the whole sequence is present,
also under sequence or context parallelism.
The last segment of a sample absorbs the sample's padding (as TE's padded THD layout expects);
padding tokens are never inside a real segment, so they attend to nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dfm.models.attention.segments import PackedSegments


@dataclass
class FactorizedAttentionParams:
    spatial: PackedSegments  # per-frame segments, token order
    temporal: PackedSegments  # per-(h, w) segments; token_order: (to_temporal [S], to_token [S])


def _cumulative(lengths: list[Tensor]) -> Tensor:
    lengths = torch.cat(lengths) if lengths else torch.zeros(0, dtype=torch.long)
    return torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32)


def _segments(starts: list[Tensor], lengths: list[Tensor], total: int, device, token_order=None) -> PackedSegments:
    """Segments given by their starts and real lengths; each padded segment runs to the next start.
    Built on the host; a copy on ``device`` keeps the host one as ``host``."""

    def segments(cu: Tensor, offsets: Tensor, host=None) -> PackedSegments:
        return PackedSegments(
            qkv_format="sbhd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=offsets,
            cu_seqlens_kv_padded=offsets,
            token_order=token_order,
            host=host,
        )

    host = segments(_cumulative(lengths), torch.cat([torch.cat(starts), torch.tensor([total])]).to(torch.int32))
    if torch.device(device).type == "cpu":
        return host
    return segments(host.cu_seqlens_q.to(device), host.cu_seqlens_q_padded.to(device), host)


def sample_grids(latent_shape: Tensor, patch_temporal: int, patch_spatial: int) -> list[tuple[int, int, int]]:
    """latent_shape [N, 4] (C, T, H, W) -> per-sample token grid (t, h, w)."""
    return [(t // patch_temporal, h // patch_spatial, w // patch_spatial) for _, t, h, w in latent_shape.tolist()]


def factorized_params(
    cu_seqlens_padded: Tensor, grids: list[tuple[int, int, int]], device: torch.device | None = None
) -> FactorizedAttentionParams:
    """Spatial / temporal segments and the temporal permutation for a pack of samples, on ``device``
    (default: the offsets'; pass host offsets to build them without a device sync)."""
    offsets = cu_seqlens_padded.tolist()
    total = offsets[-1]
    device = cu_seqlens_padded.device if device is None else device
    to_temporal = torch.arange(total)
    spatial_starts, spatial_lens, temporal_starts, temporal_lens = [], [], [], []
    for start, (t, h, w) in zip(offsets[:-1], grids):
        hw = h * w
        spatial_starts.append(start + hw * torch.arange(t))
        spatial_lens.append(torch.full((t,), hw))
        temporal_starts.append(start + t * torch.arange(hw))
        temporal_lens.append(torch.full((hw,), t))
        # Token (tt, p) sits at tt*hw + p; in temporal order it goes to p*t + tt.
        to_temporal[start : start + t * hw] = start + torch.arange(t * hw).reshape(t, hw).T.reshape(-1)
    order = (to_temporal.to(device), torch.argsort(to_temporal).to(device))
    return FactorizedAttentionParams(
        spatial=_segments(spatial_starts, spatial_lens, total, device),
        temporal=_segments(temporal_starts, temporal_lens, total, device, token_order=order),
    )
