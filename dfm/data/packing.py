"""Concatenate encoded samples into one THD pack (see packed_batch.py for the layout)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields

import torch

from dfm.data.packed_batch import PackedBatch, segment_lengths
from dfm.data.sample import DiffusionSample


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def padded_lengths(lengths: Sequence[int], segment_multiple: int, total_multiple: int) -> list[int]:
    """Per-sample lengths padded to ``segment_multiple``; the last one also pads the total to ``total_multiple``."""
    padded = [round_up(max(n, 1), segment_multiple) for n in lengths]
    padded[-1] += round_up(sum(padded), total_multiple) - sum(padded)
    return padded


def cumulative(lengths: Sequence[int]) -> torch.Tensor:
    """Per-segment lengths [N] -> int32 offsets [N+1] (0 first)."""
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
    kv2_offsets = cumulative(padded_lengths(kv2_lens, 1, total_multiple))
    return dict(
        condition=_scatter_segments([s.condition.float() for s in samples], q_offsets, int(q_offsets[-1])),
        context_2=_scatter_segments([s.text_2 for s in samples], kv2_offsets, int(kv2_offsets[-1])),
        cu_seqlens_kv2=cumulative(kv2_lens),
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


def grouped_by_length(samples: Sequence[DiffusionSample]) -> list[DiffusionSample]:
    """``samples`` with equal token counts side by side: the lengths in order of first appearance, each
    length's samples in their own order. Attention then reads a length's segments as one strided view
    (segment_plan.py) instead of gathering them by index and scattering the results back (measured:
    ~6 % of a step of the small-4k-mix rung, four sample shapes). A sample's noise, level and loss do
    not depend on its place in the pack (forward_step.py), so the order changes nothing else."""
    order = {}
    for sample in samples:
        order.setdefault(sample.seq_len_q, len(order))
    return sorted(samples, key=lambda sample: order[sample.seq_len_q])


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
    # Text is split over TP ranks too under sequence parallelism: pad its total the same way. A pack of
    # one shape (every sample the same token count) pads each caption to its longest, as a dense batch
    # does: cross-attention then reads each sample's keys at one stride (views, no gathers).
    text_multiple = max(*kv_lens, 1) if len(set(q_lens)) == 1 else 1
    kv_padded = padded_lengths(kv_lens, text_multiple, total_multiple)
    q_offsets, kv_offsets = cumulative(q_padded), cumulative(kv_padded)
    total_q, total_kv = int(q_offsets[-1]), int(kv_offsets[-1])
    ones = [torch.ones(n) for n in q_lens]
    return PackedBatch(
        latents=_scatter_segments([s.tokens for s in samples], q_offsets, total_q),
        context=_scatter_segments([s.text for s in samples], kv_offsets, total_kv),
        cu_seqlens_q=cumulative(q_lens),
        cu_seqlens_q_padded=q_offsets,
        cu_seqlens_kv=cumulative(kv_lens),
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


# Fields of a PackedBatch by what they are indexed by (the rest are per sample, [N, ...]).
_TOKEN_FIELDS = ("latents", "pos_ids", "loss_mask", "condition", "image_condition", "noise")
_TEXT_FIELDS = {"context": "cu_seqlens_kv", "context_2": "cu_seqlens_kv2"}
_OFFSETS = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_kv2")


def segment_rows(cu_seqlens_padded: torch.Tensor, keep: Sequence[int]) -> torch.Tensor:
    """[sum of the kept segments] long: the rows of the segments ``keep`` of a pack, in order."""
    starts = cu_seqlens_padded[:-1].tolist()
    lengths = segment_lengths(cu_seqlens_padded).tolist()
    return torch.cat([torch.arange(starts[i], starts[i] + lengths[i]) for i in keep])


def repadded_offsets(cu_seqlens_padded: torch.Tensor, keep: Sequence[int], total_multiple: int) -> torch.Tensor:
    """[len(keep)+1] int32: the kept segments' padded offsets in a pack of their own, whose last
    segment pads the total to ``total_multiple`` (as ``pack_samples`` does)."""
    lengths = [int(segment_lengths(cu_seqlens_padded)[i]) for i in keep]
    lengths[-1] += round_up(sum(lengths), total_multiple) - sum(lengths)
    return cumulative(lengths)


def rows_padded(values: torch.Tensor, rows: torch.Tensor, total: int) -> torch.Tensor:
    """values[rows] [len(rows), ...] followed by zero rows up to ``total``."""
    out = values.new_zeros((total, *values.shape[1:]))
    out[: len(rows)] = values[rows]
    return out


def sub_pack(batch: PackedBatch, keep: Sequence[int], total_multiple: int = 1) -> tuple[PackedBatch, torch.Tensor]:
    """The samples ``keep`` (indices into the host ``batch``) as a pack of their own -> (that pack,
    rows [S_keep] long: the row of ``batch`` each of its first S_keep video rows is). Every kept
    sample keeps its padded segments; only the totals are padded again to ``total_multiple``
    (sequence parallelism's tp), as ``pack_samples`` pads them."""
    keep = list(keep)
    parts = {}
    q_offsets = repadded_offsets(batch.cu_seqlens_q_padded, keep, total_multiple)
    rows = segment_rows(batch.cu_seqlens_q_padded, keep)
    for name in _TOKEN_FIELDS:
        value = getattr(batch, name)
        parts[name] = None if value is None else rows_padded(value, rows, int(q_offsets[-1]))
    parts["cu_seqlens_q_padded"] = q_offsets
    for name, offsets in _TEXT_FIELDS.items():
        padded = getattr(batch, f"{offsets}_padded")
        if padded is None:
            continue
        text_offsets = repadded_offsets(padded, keep, total_multiple)
        parts[f"{offsets}_padded"] = text_offsets
        parts[name] = rows_padded(getattr(batch, name), segment_rows(padded, keep), int(text_offsets[-1]))
    for name in _OFFSETS:
        offsets = getattr(batch, name)
        if offsets is not None:
            parts[name] = cumulative(segment_lengths(offsets)[keep].tolist())
    index = torch.tensor(keep, dtype=torch.long)
    for f in fields(batch):
        value = getattr(batch, f.name)
        if f.name not in parts and f.name != "host" and value is not None:
            parts[f.name] = value[index]  # per sample
    return PackedBatch(**parts), rows
