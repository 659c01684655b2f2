"""How a pack's tokens are split over context-parallel (CP) ranks.

Split (the layout TE's THD context parallelism and megatron use): every sample's padded segment
is cut into 2*cp equal chunks and CP rank r keeps chunks r and 2*cp-1-r, so each rank holds an
equal share of every sample. The data pads segments to a multiple of 2*cp
(`ParallelLayout.padding_multiples`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from torch import Tensor


def load_balanced_positions(cu_seqlens_padded: Tensor, size: int, rank: int) -> Tensor:
    """[S/size] long: the pack positions CP rank ``rank`` holds (chunks r and 2*size-1-r of each segment)."""
    positions = []
    offsets = cu_seqlens_padded.tolist()
    for start, end in zip(offsets[:-1], offsets[1:]):
        if (end - start) % (2 * size):
            raise ValueError(f"a segment of {end - start} tokens cannot be split into 2*cp={2 * size} chunks")
        chunk = (end - start) // (2 * size)
        for index in (rank, 2 * size - 1 - rank):
            positions.append(torch.arange(start + index * chunk, start + (index + 1) * chunk))
    return torch.cat(positions)


@dataclass
class SequenceSplit:
    """Which tokens of a pack this CP rank holds. size == 1: the whole pack, every op a no-op."""

    size: int
    group: torch.distributed.ProcessGroup | None = None
    local_positions: Tensor | None = None  # [S/cp] long, pack positions held here
    from_gathered: Tensor | None = None  # [S] long, all ranks' tokens (rank-major) -> token order
    to_gathered: Tensor | None = None  # [S] long, the inverse permutation
    cu_local: Tensor | None = None  # [N+1] int32, sample segments of the local tokens
    cu_local_host: Tensor | None = None  # the same on the host

    def local(self, tensor: Tensor) -> Tensor:
        """[S, ...] -> [S/cp, ...], this rank's tokens."""
        return tensor if self.size == 1 else tensor[self.local_positions.to(tensor.device)]

    def gather(self, tensor: Tensor, grad_is_partial: bool) -> Tensor:
        """[S/cp, ...] -> [S, ...] in token order. ``grad_is_partial``: each rank's gradient holds
        only its own queries' share (K/V) and is summed; otherwise every rank has the same
        gradient (a loss computed on the gathered tensor) and keeps its own rows."""
        if self.size == 1:
            return tensor
        gathered = gather_from_sequence_parallel_region(tensor, grad_is_partial, group=self.group)
        return gathered[self.from_gathered.to(tensor.device)]


def split_for_rank(
    cu_seqlens_padded: Tensor,
    size: int,
    rank: int,
    group: torch.distributed.ProcessGroup | None,
    device: torch.device | None = None,
) -> SequenceSplit:
    """CP rank ``rank``'s share (of ``size`` ranks in ``group``) of a pack with segment offsets
    ``cu_seqlens_padded [N+1]`` (pass host offsets and the pack's ``device`` to build the indices
    without a device sync). The layout picks size, rank and group (`ParallelLayout.sequence_split`)."""
    if size == 1:
        return SequenceSplit(size=1)
    device = cu_seqlens_padded.device if device is None else device
    cu = cu_seqlens_padded.cpu()
    per_rank = [load_balanced_positions(cu, size, r) for r in range(size)]
    to_gathered = torch.cat(per_rank)
    return SequenceSplit(
        size=size,
        group=group,
        local_positions=per_rank[rank].to(device),
        from_gathered=torch.argsort(to_gathered).to(device),
        to_gathered=to_gathered.to(device),
        cu_local=(cu // size).to(device=device, dtype=torch.int32),
        cu_local_host=(cu // size).to(torch.int32),
    )
