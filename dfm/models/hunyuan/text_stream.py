"""HunyuanVideo 1.5's text stream: per sample [image tokens (i2v only), ByT5 tokens, Qwen tokens].

diffusers concatenates, per sample, the valid SigLIP image tokens, the valid ByT5 tokens and the valid
Qwen2.5-VL tokens (then invalid ones, masked out) into the text side of the joint attention; a
text-to-video sample's image tokens are all invalid. Here the three embedded sources are stacked
([image rows of the i2v samples, ByT5 rows, Qwen rows, one zero row]) and one host-built gather
puts each sample's real rows first in its text segment; padding rows (to the SP multiple) read the
zero row and are masked like any padding. The joint-attention plan then sees an ordinary text
layout (``text_view``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from dfm.data.packed_batch import PackedBatch
from dfm.data.packing import cumulative
from dfm.models.attention.segments import PackedSegments
from dfm.models.common.packed_segments import packed_segments


def text_segments(cu_real: Tensor, cu_padded: Tensor, device) -> PackedSegments:
    """Self-attention segments over one text layout (host cu_seqlens [N+1]): each sample's real rows."""
    return packed_segments(cu_real, cu_padded, cu_real, cu_padded, device)


@dataclass
class TextStreamPlan:
    """Index plan of one pack's text stream (host math, device tensors)."""

    i2v_samples: Tensor  # [n_i2v] long: samples with image embeddings
    order: Tensor  # [T] long: rows of cat(image, byt5, qwen, zero row) -> the text stream
    cu_real: Tensor  # [N+1] int32 host: real text-stream tokens per sample
    cu_padded: Tensor  # [N+1] int32 host: text-stream segments, padding included; [-1] == T
    qwen_segments: PackedSegments  # the refiner's self-attention over each sample's Qwen tokens
    qwen_sample_ids: Tensor  # [S_kv] long: sample of each Qwen row (padding: its segment's sample)
    qwen_real_rows: Tensor  # [real Qwen tokens] long
    qwen_lengths: Tensor  # [N] float: real Qwen tokens per sample (the pooled mean's divisor)


def _sample_ids(cu_padded: list[int]) -> Tensor:
    lengths = torch.tensor(cu_padded[1:]) - torch.tensor(cu_padded[:-1])
    return torch.repeat_interleave(torch.arange(len(lengths)), lengths)


def _real_rows(cu_real: list[int], cu_padded: list[int]) -> list[Tensor]:
    return [torch.arange(start, start + cu_real[i + 1] - cu_real[i]) for i, start in enumerate(cu_padded[:-1])]


def is_image_conditioned(image_embeds: Tensor | None) -> list[bool]:
    """Per sample: whether its image embedding is set (diffusers treats all zeros as text-to-video)."""
    if image_embeds is None:
        return []
    return image_embeds.flatten(1).ne(0).any(dim=1).tolist()


def text_stream_plan(batch: PackedBatch, total_multiple: int) -> TextStreamPlan:
    """The plan of ``batch``; the stream's length is padded to ``total_multiple`` (SP's TP size)."""
    host, device = batch.host_view(), batch.latents.device
    n = host.num_samples
    qwen_real, qwen_pad = host.cu_seqlens_kv.tolist(), host.cu_seqlens_kv_padded.tolist()
    if host.context_2 is None:
        byt5_real = byt5_pad = [0] * (n + 1)
    else:
        byt5_real, byt5_pad = host.cu_seqlens_kv2.tolist(), host.cu_seqlens_kv2_padded.tolist()
    i2v = [i for i, conditioned in enumerate(is_image_conditioned(host.image_embeds)) if conditioned]
    image_len = 0 if host.image_embeds is None else int(host.image_embeds.shape[1])
    byt5_base = len(i2v) * image_len
    qwen_base = byt5_base + byt5_pad[-1]
    zero_row = qwen_base + qwen_pad[-1]
    byt5_rows, qwen_rows = _real_rows(byt5_real, byt5_pad), _real_rows(qwen_real, qwen_pad)
    rows, real_lengths = [], []
    for i in range(n):
        image = torch.arange(image_len) + i2v.index(i) * image_len if i in i2v else torch.arange(0)
        sample = torch.cat([image, byt5_base + byt5_rows[i], qwen_base + qwen_rows[i]])
        rows.append(sample)
        real_lengths.append(len(sample))
    padded_lengths = list(real_lengths)
    padded_lengths[-1] += -sum(real_lengths) % total_multiple
    rows.append(torch.full((sum(padded_lengths) - sum(real_lengths),), zero_row))
    qwen_lengths = torch.tensor(qwen_real[1:]) - torch.tensor(qwen_real[:-1])
    return TextStreamPlan(
        i2v_samples=torch.tensor(i2v, dtype=torch.long).to(device),
        order=torch.cat(rows).long().to(device),
        cu_real=cumulative(real_lengths),
        cu_padded=cumulative(padded_lengths),
        qwen_segments=text_segments(host.cu_seqlens_kv, host.cu_seqlens_kv_padded, device),
        qwen_sample_ids=_sample_ids(qwen_pad).to(device),
        qwen_real_rows=torch.cat(qwen_rows).long().to(device),
        qwen_lengths=qwen_lengths.float().to(device),
    )


def text_view(batch: PackedBatch, plan: TextStreamPlan) -> PackedBatch:
    """``batch`` with the text stream's segments in place of the Qwen text's (for the joint attention)."""
    host = batch.host_view()
    host = dataclasses.replace(host, cu_seqlens_kv=plan.cu_real, cu_seqlens_kv_padded=plan.cu_padded, host=None)
    device = batch.latents.device
    return dataclasses.replace(
        batch, cu_seqlens_kv=plan.cu_real.to(device), cu_seqlens_kv_padded=plan.cu_padded.to(device), host=host
    )
