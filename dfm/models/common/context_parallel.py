"""Context parallelism (CP) for THD packs: each sample's tokens split over the CP ranks.

Split (the layout TE's THD context parallelism and megatron use): every sample's padded segment
is cut into 2*cp equal chunks and CP rank r keeps chunks r and 2*cp-1-r, so each rank holds an
equal share of every sample. The data pads segments to a multiple of 2*cp
(`ParallelLayout.padding_multiples`).

Attention on the local tokens, computed exactly (the local backend; TE does its own CP):
  * self-attention (DiT, MovieGen): all-gather K and V over CP (backward reduce-scatters dK/dV),
    put them back in token order and attend each local query to its sample's full K/V;
  * cross-attention: the text is not split, every rank holds it; only the queries are local;
  * factorized attention (ST-DiT): all-to-all from [s/cp, heads] to [s, heads/cp] (Ulysses), so
    per-frame and per-position segments are whole on every rank; attend; all-to-all back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.mappings import all_to_all, gather_from_sequence_parallel_region
from torch import Tensor

from dfm.models.common.packed_attention import document_ids_on_device, host_segments

Kernel = Callable[[Tensor, Tensor, Tensor, PackedSeqParams], Tensor]  # q, k, v [s, b, np, hn] -> [s, b, np, hn]


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


@dataclass
class LocalQueryAttention:
    """Local queries against their samples' whole K/V: self-attention (K/V all-gathered over CP)
    or cross-attention (text K/V held whole by every rank)."""

    split: SequenceSplit
    params: PackedSeqParams  # q side: local segments (all rows), kv side: whole segments
    q_valid: Tensor  # [S/cp, 1, 1, 1] bool
    gather_kv: bool

    def __call__(self, kernel: Kernel, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        if self.gather_kv:
            key, value = self.split.gather(key, True), self.split.gather(value, True)
        # Padding rows of a local segment may see keys; zero them as the single-process kernels do.
        return kernel(query, key, value, self.params) * self.q_valid.to(query.dtype)


def local_query_attention(params: PackedSeqParams, split: SequenceSplit, self_attention: bool) -> LocalQueryAttention:
    """CP attention for ``params`` (whole-pack segments) when this rank holds ``split``'s queries."""
    host = host_segments(params)
    local = dataclasses.replace(params, cu_seqlens_q=split.cu_local, cu_seqlens_q_padded=split.cu_local)
    if host is not params:
        local.host = dataclasses.replace(
            host, cu_seqlens_q=split.cu_local_host, cu_seqlens_q_padded=split.cu_local_host
        )
    total, device = int(host.cu_seqlens_q_padded[-1]), params.cu_seqlens_q_padded.device
    real = document_ids_on_device(params, "q", total, device) >= 0
    return LocalQueryAttention(split, local, split.local(real)[:, None, None, None], gather_kv=self_attention)


@dataclass
class UlyssesAttention:
    """All-to-all re-sharding: tokens split over CP -> heads split over CP, attend on the whole
    pack (any segments, e.g. ST-DiT's per-frame ones), and back. Needs heads % cp == 0."""

    split: SequenceSplit
    params: PackedSeqParams  # whole-pack segments

    def __call__(self, kernel: Kernel, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        q, k, v = (self.heads_to_sequence(t) for t in (query, key, value))
        return self.sequence_to_heads(kernel(q, k, v, self.params))

    def heads_to_sequence(self, tensor: Tensor) -> Tensor:
        """[S/cp, b, np, hn] -> [S, b, np/cp, hn] in token order."""
        s, b, np, hn = tensor.shape
        cp = self.split.size
        by_head_group = tensor.reshape(s, b, cp, np // cp, hn).permute(2, 0, 1, 3, 4).reshape(cp * s, b, np // cp, hn)
        # Rank j receives head group j of every rank's tokens, rank-major: the gathered order.
        gathered = all_to_all(self.split.group, by_head_group)
        return gathered[self.split.from_gathered.to(tensor.device)]

    def sequence_to_heads(self, tensor: Tensor) -> Tensor:
        """[S, b, np/cp, hn] in token order -> [S/cp, b, np, hn] (this rank's tokens, all heads)."""
        gathered = tensor[self.split.to_gathered.to(tensor.device)]
        per_head_group = all_to_all(self.split.group, gathered)  # block j: head group j of my tokens
        cp = self.split.size
        s, b, heads, hn = per_head_group.shape[0] // cp, *per_head_group.shape[1:]
        return per_head_group.reshape(cp, s, b, heads, hn).permute(1, 2, 0, 3, 4).reshape(s, b, cp * heads, hn)
