"""Concatenate encoded samples into one THD pack (see packed_batch.py for the layout)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dfm.data.packed_batch import PackedBatch
from dfm.data.sample import DiffusionSample


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def padded_lengths(lengths: Sequence[int], segment_multiple: int, total_multiple: int) -> list[int]:
    """Per-sample lengths padded to ``segment_multiple``; the last one also pads the total to ``total_multiple``."""
    padded = [round_up(max(n, 1), segment_multiple) for n in lengths]
    padded[-1] += round_up(sum(padded), total_multiple) - sum(padded)
    return padded


def _cumulative(lengths: Sequence[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(list(lengths)).cumsum(0).tolist()], dtype=torch.int32)


def _scatter_segments(parts: Sequence[torch.Tensor], offsets: torch.Tensor, total: int) -> torch.Tensor:
    out = parts[0].new_zeros((total, *parts[0].shape[1:]))
    for part, start in zip(parts, offsets.tolist()):
        out[start : start + part.shape[0]] = part
    return out


def stack_pooled_text(samples: Sequence[DiffusionSample]) -> torch.Tensor | None:
    """[N, D_pool] when the samples carry pooled text vectors, None when none does."""
    pooled = [s.pooled_text for s in samples]
    if all(p is None for p in pooled):
        return None
    if any(p is None for p in pooled):
        missing = [s.metadata.get("key", s.sample_index) for s in samples if s.pooled_text is None]
        raise ValueError(f"samples {missing} have no pooled text vector while others in their pack do")
    return torch.stack(pooled).float()


def condition_parts(samples: Sequence[DiffusionSample], q_offsets: torch.Tensor, total_multiple: int) -> dict:
    """PackedBatch's HunyuanVideo 1.5 fields of ``samples`` (empty when no sample has them); the
    second text is padded as the first."""
    if all(s.condition is None and s.text_2 is None and s.image_embeds is None for s in samples):
        return {}
    missing = [s.metadata.get("key", s.sample_index) for s in samples if s.condition is None or s.text_2 is None]
    if missing or any(s.image_embeds is None for s in samples):
        raise ValueError(
            f"samples {missing} lack condition / text_2 / image_embeds while others in their pack have them"
        )
    kv2_lens = [int(s.text_2.shape[0]) for s in samples]
    kv2_offsets = _cumulative(padded_lengths(kv2_lens, 1, total_multiple))
    return dict(
        condition=_scatter_segments([s.condition.float() for s in samples], q_offsets, int(q_offsets[-1])),
        context_2=_scatter_segments([s.text_2 for s in samples], kv2_offsets, int(kv2_offsets[-1])),
        cu_seqlens_kv2=_cumulative(kv2_lens),
        cu_seqlens_kv2_padded=kv2_offsets,
        image_embeds=torch.stack([s.image_embeds for s in samples]).float(),
    )


def first_frame_flags(samples: Sequence[DiffusionSample]) -> torch.Tensor | None:
    """[N] bool when a sample's first frame is a clean condition (Wan 2.2 TI2V), None when none is."""
    flags = [s.first_frame_clean for s in samples]
    return torch.tensor(flags, dtype=torch.bool) if any(flags) else None


def image_condition_tokens(samples: Sequence[DiffusionSample], q_offsets: torch.Tensor) -> torch.Tensor | None:
    """[S, D_cond] Wan 2.2 I2V condition tokens laid out as the latents; None when no sample has them."""
    conditions = [s.image_condition for s in samples]
    if all(c is None for c in conditions):
        return None
    missing = [s.metadata.get("key", s.sample_index) for s in samples if s.image_condition is None]
    if missing:
        raise ValueError(f"samples {missing} have no image condition while others in their pack do")
    return _scatter_segments([c.float() for c in conditions], q_offsets, int(q_offsets[-1]))


def pack_samples(samples: Sequence[DiffusionSample], segment_multiple: int = 1, total_multiple: int = 1) -> PackedBatch:
    """Pack samples along the sequence.

    ``segment_multiple`` pads every sample's video segment (context parallelism needs 2*cp);
    ``total_multiple`` pads the whole pack (sequence parallelism needs tp*cp). Padding is masked out.
    """
    if not samples:
        raise ValueError("cannot pack an empty list of samples")
    q_lens = [s.seq_len_q for s in samples]
    kv_lens = [s.seq_len_kv for s in samples]
    q_padded = padded_lengths(q_lens, segment_multiple, total_multiple)
    # Text is split over TP ranks too under sequence parallelism: pad its total the same way.
    kv_padded = padded_lengths(kv_lens, 1, total_multiple)
    q_offsets, kv_offsets = _cumulative(q_padded), _cumulative(kv_padded)
    total_q, total_kv = int(q_offsets[-1]), int(kv_offsets[-1])
    ones = [torch.ones(n) for n in q_lens]
    return PackedBatch(
        latents=_scatter_segments([s.tokens for s in samples], q_offsets, total_q),
        context=_scatter_segments([s.text for s in samples], kv_offsets, total_kv),
        cu_seqlens_q=_cumulative(q_lens),
        cu_seqlens_q_padded=q_offsets,
        cu_seqlens_kv=_cumulative(kv_lens),
        cu_seqlens_kv_padded=kv_offsets,
        pos_ids=_scatter_segments([s.pos_ids.long() for s in samples], q_offsets, total_q),
        loss_mask=_scatter_segments(ones, q_offsets, total_q),
        latent_shape=torch.tensor([list(s.latent_shape) for s in samples], dtype=torch.long),
        sample_index=torch.tensor([s.sample_index for s in samples], dtype=torch.long),
        pooled_text=stack_pooled_text(samples),
        **condition_parts(samples, q_offsets, total_multiple),
        first_frame_clean=first_frame_flags(samples),
        image_condition=image_condition_tokens(samples, q_offsets),
    )
