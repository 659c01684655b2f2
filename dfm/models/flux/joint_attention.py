"""FLUX's joint attention over THD packs: each sample attends over [its text tokens, its image tokens].

The streams arrive apart (text [S_kv] whole on every CP rank, image [s] this CP rank's share), so
one plan per pack says how to assemble per-sample joint segments and take them apart again:

* queries: every text row and every local image row, grouped by sample ([text_i, image_i]); a
  sample's rows form one segment (padding rows included, their output zeroed after);
* keys / values: the real text rows and the real rows of the whole image (all-gathered over CP),
  per sample [text_i, image_i].

Under CP the text stream is computed whole by every CP rank, as DiT's cross-attention text is: each
rank's gradients hold its own queries' share, summed over CP with the data-parallel reduction.

The output projections read each stream's rows of the kernel's output (``stream_rows``); they keep
the kernel's output (which the kernel keeps anyway) instead of their gathered input (common/rebuilt.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dfm.data.packed_batch import PackedBatch
from dfm.data.packing import cumulative
from dfm.models.attention.segments import PackedSegments
from dfm.models.common.packed_segments import packed_segments
from dfm.models.flux.rope import rope_cos_sin
from dfm.parallel.sequence_split import SequenceSplit


@dataclass
class QKV:
    """One stream's projected heads, each [s, b, np, hn]."""

    query: Tensor
    key: Tensor
    value: Tensor


@dataclass
class JointAttentionPlan:
    """Index plan of one pack (built once, read by every block)."""

    params: PackedSegments  # joint segments: q side all rows, kv side real rows
    q_order: Tensor  # [S_kv + s] long: cat(text, local image) rows -> joint query order
    q_inverse: Tensor  # [S_kv + s] long: the inverse permutation
    kv_order: Tensor  # [real joint tokens] long: rows of cat(text, whole image) -> joint key order
    q_valid: Tensor  # [S_kv + s, 1, 1] in cat order: 1 on real tokens, 0 on padding
    split: SequenceSplit  # this CP rank's share of the image tokens
    rope: tuple[Tensor, Tensor]  # (cos, sin) [s, 1, 1, hn] of the local image tokens
    num_text: int  # S_kv


def joint_attention_plan(
    batch: PackedBatch, split: SequenceSplit, axes_dim: list[int], theta: float = 10000.0
) -> JointAttentionPlan:
    """The plan for ``batch`` on this CP rank (host index math, one copy to the device); ``theta``: the RoPE base."""
    host, device = batch.host_view(), batch.latents.device
    text_pad, image_pad = host.cu_seqlens_kv_padded.tolist(), host.cu_seqlens_q_padded.tolist()
    text_len, image_len = host.text_lengths.tolist(), host.sample_lengths.tolist()
    local = (split.cu_local_host if split.size > 1 else host.cu_seqlens_q_padded).tolist()
    num_text = text_pad[-1]
    q_rows, kv_rows, q_lengths, kv_lengths, text_valid = [], [], [], [], []
    for i in range(host.num_samples):
        text = torch.arange(text_pad[i], text_pad[i + 1])
        q_rows += [text, num_text + torch.arange(local[i], local[i + 1])]
        q_lengths.append(len(text) + local[i + 1] - local[i])
        kv_rows += [text[: text_len[i]], num_text + torch.arange(image_pad[i], image_pad[i] + image_len[i])]
        kv_lengths.append(text_len[i] + image_len[i])
        text_valid.append(torch.arange(len(text)) < text_len[i])
    q_order = torch.cat(q_rows)
    cu_q, cu_kv = cumulative(q_lengths), cumulative(kv_lengths)
    image_valid = split.local(host.loss_mask != 0)
    q_valid = torch.cat([*text_valid, image_valid]).float()[:, None, None]
    cos, sin = rope_cos_sin(split.local(host.pos_ids), axes_dim, theta)
    return JointAttentionPlan(
        params=packed_segments(cu_q, cu_q, cu_kv, cu_kv, device),
        q_order=q_order.to(device),
        q_inverse=torch.argsort(q_order).to(device),
        kv_order=torch.cat(kv_rows).to(device),
        q_valid=q_valid.to(device),
        split=split,
        rope=(cos.to(device), sin.to(device)),
        num_text=num_text,
    )


def joint_attention(core_attention, plan: JointAttentionPlan, text: QKV, image: QKV) -> Tensor:
    """text heads [S_kv, b, np, hn], image heads [s, b, np, hn] (RoPE applied) -> the kernel's output
    [S_kv + s, b, np*hn] in joint order (``stream_rows`` takes each stream's rows of it)."""
    image_key = plan.split.gather(image.key, grad_is_partial=True)
    image_value = plan.split.gather(image.value, grad_is_partial=True)
    query = torch.cat([text.query, image.query])[plan.q_order]
    key = torch.cat([text.key, image_key])[plan.kv_order]
    value = torch.cat([text.value, image_value])[plan.kv_order]
    return core_attention(query, key, value, attention_mask=None, packed_seq_params=plan.params)


def stream_rows(plan: JointAttentionPlan, text: bool, joint_out: Tensor) -> Tensor:
    """The text (or image) stream's rows [S_kv or s, b, np*hn] of the joint output, padding rows 0."""
    rows = slice(None, plan.num_text) if text else slice(plan.num_text, None)
    return joint_out[plan.q_inverse[rows]] * plan.q_valid[rows].to(joint_out.dtype)
