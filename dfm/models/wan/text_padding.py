"""Wan attends to its text padded to a fixed length with zero embeddings (WanPipeline pads every
prompt's UMT5 features to 512 tokens; the zero rows pass the text MLP and are attended to). dfm
packs only each sample's real text, so the Wan model pads it back per sample before embedding it.
"""

from __future__ import annotations

import dataclasses

import torch

from dfm.data.packed_batch import PackedBatch


def text_slots(batch: PackedBatch, text_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows of the real text in ``batch.context``, their rows in the padded [N * text_len] layout), host longs."""
    host = batch.host_view()
    lengths, starts = host.text_lengths.tolist(), host.cu_seqlens_kv_padded[:-1].tolist()
    too_long = [(i, n) for i, n in enumerate(lengths) if n > text_len]
    if too_long:
        index, length = too_long[0]
        raise ValueError(
            f"sample {int(host.sample_index[index])} has {length} text tokens, more than model.max_text_len={text_len}"
        )
    rows = [start + j for start, n in zip(starts, lengths) for j in range(n)]
    slots = [i * text_len + j for i, n in enumerate(lengths) for j in range(n)]
    return torch.tensor(rows, dtype=torch.long), torch.tensor(slots, dtype=torch.long)


def pad_text_per_sample(batch: PackedBatch, text_len: int) -> PackedBatch:
    """``batch`` with each sample's text zero-padded to ``text_len`` tokens: context [N * text_len, D]."""
    rows, slots = text_slots(batch, text_len)
    device = batch.context.device
    context = batch.context.new_zeros(batch.num_samples * text_len, batch.context.shape[-1])
    context[slots.to(device)] = batch.context[rows.to(device)]
    cu_seqlens = torch.arange(batch.num_samples + 1, dtype=torch.int32) * text_len
    host = None if batch.host is None else pad_text_per_sample(batch.host, text_len)
    return dataclasses.replace(
        batch,
        context=context,
        cu_seqlens_kv=cu_seqlens.to(device),
        cu_seqlens_kv_padded=cu_seqlens.to(device),
        host=host,
    )
