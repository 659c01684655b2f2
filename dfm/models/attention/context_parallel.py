"""Context parallelism (CP) for THD packs: each sample's tokens split over the CP ranks.

The split of a pack over CP ranks is the layout's (dfm/parallel/sequence_split.py); this module
holds the attention on the local tokens.

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

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.mappings import all_to_all
from torch import Tensor

from dfm.models.attention.segments import document_ids_on_device, host_segments
from dfm.parallel.sequence_split import SequenceSplit

Kernel = Callable[[Tensor, Tensor, Tensor, PackedSeqParams], Tensor]  # q, k, v [s, b, np, hn] -> [s, b, np, hn]


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
