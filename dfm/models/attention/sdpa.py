"""The reference backend: torch SDPA on each sample's segment (``sdpa``), exact on every device.

On the CPU's flash kernel segments of one length run as one batched call (segment_plan.py);
elsewhere one SDPA call per segment."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

from dfm.models.attention.sdpa_cpu import grouped_attention_cpu, heads_first, padded_concat, uses_cpu_flash
from dfm.models.attention.segment_plan import segment_plan
from dfm.models.attention.segments import segment_bounds


def sdpa_per_segment(query: Tensor, key: Tensor, value: Tensor, params: PackedSeqParams, scale: float) -> Tensor:
    """query [sq, b, np, hn], key/value [sk, b, np, hn] -> [sq, b, np, hn]; padding rows are 0.

    The output is one buffer written once: on the CPU's flash kernel the only copy kept for backward
    (sdpa_cpu.py); elsewhere the segments' outputs concatenated with zero padding rows."""
    if uses_cpu_flash(query, key, value, scale):
        plan = segment_plan(params, query.shape[0], key.shape[0], query.device)
        return torch.zeros_like(query) if plan is None else grouped_attention_cpu(query, key, value, plan, scale)
    return sdpa_segment_loop(query, key, value, params, scale)


def sdpa_segment_loop(query: Tensor, key: Tensor, value: Tensor, params: PackedSeqParams, scale: float) -> Tensor:
    """The same, one SDPA call per sample segment: the reference the grouped calls are tested against."""
    q_starts, q_lens = segment_bounds(params, "q")
    kv_starts, kv_lens = segment_bounds(params, "kv")
    segments = [seg for seg in zip(q_starts, q_lens, kv_starts, kv_lens) if seg[1] and seg[3]]
    q, k, v = heads_first(query), heads_first(key), heads_first(value)
    outputs = []
    for q0, nq, k0, nk in segments:
        out = F.scaled_dot_product_attention(
            q[:, :, q0 : q0 + nq], k[:, :, k0 : k0 + nk], v[:, :, k0 : k0 + nk], scale=scale
        )
        outputs.append((q0, out.permute(2, 0, 1, 3)))
    return padded_concat(query, outputs) if outputs else torch.zeros_like(query)
