"""Core attention over THD-packed sequences: no token attends across samples.

One module per backend, all with the kernel contract ``(q, k, v, params, scale) -> out`` on
megatron's ``sbhd`` layout (b == 1 for a pack; padding query rows are 0):

* ``sdpa`` (sdpa.py): torch SDPA per sample segment, the reference; on the CPU one flash call per
  segment length (segment_plan.py);
* ``flex`` (flex.py): one FlexAttention call with a document block mask;
* ``varlen`` (varlen.py): torch's variable-length flash kernel (CUDA);
* ``te`` (te.py): Transformer Engine's THD attention, its own megatron module.

core.py plugs the first three into megatron's ``SelfAttention`` / ``CrossAttention`` as the
``core_attention`` submodule; segments.py holds the pack's segments (``PackedSegments``),
context_parallel.py how they are split over CP ranks. The backend is chosen in one place:
``dfm.models.build.resolve_attention_backend`` (``model.attention_backend``) and the megatron
modules of each backend in ``dfm.models.attention.modules``.
"""

from __future__ import annotations

from dfm.models.attention.flex import document_block_mask, flex_document_attention
from dfm.models.attention.sdpa import sdpa_per_segment
from dfm.models.attention.segments import PackedSegments, attend_in_segment_order, host_segments

BACKENDS = ("sdpa", "flex", "varlen")

__all__ = [
    "BACKENDS",
    "PackedSegments",
    "attend_in_segment_order",
    "document_block_mask",
    "flex_document_attention",
    "host_segments",
    "kernel_for",
    "sdpa_per_segment",
]


def kernel_for(backend: str):
    """The packed kernel of a local backend, read from this package when a module is built (so a
    benchmark variant patching ``flex_document_attention`` here reaches the models it builds)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown local attention backend {backend!r}; valid: {BACKENDS}")
    if backend == "varlen":
        from dfm.models.attention.varlen import varlen_document_attention

        return varlen_document_attention
    return flex_document_attention if backend == "flex" else sdpa_per_segment
