"""Context-parallel attention against the single-process kernels, run as 2 gloo ranks (CP=2).

Usage: torchrun --nproc-per-node 2 _cp_attention_worker.py OUT_DIR. Every rank computes the
single-process reference on the whole pack itself (same seed), then its CP share, and saves the
largest differences of outputs and input gradients per case to OUT_DIR/rank<R>.pt.
"""

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from dfm.data.packing import cumulative
from dfm.models.attention import (
    PackedSegments,
    attend_in_segment_order,
    flex_document_attention,
    sdpa_per_segment,
)
from dfm.models.attention.context_parallel import UlyssesAttention, local_query_attention
from dfm.models.common.factorized_layout import factorized_params
from dfm.parallel import ParallelLayout
from dfm.platform.distributed import destroy_distributed, initialize_distributed
from dfm.platform.process_exit import skip_final_gc_at_exit
from tests.models._helpers import segments

HEADS, HEAD_DIM = 4, 8
SCALE = HEAD_DIM**-0.5
LAYOUT = ParallelLayout(world_size=2, cp=2)


def kernel_of(backend):
    kernel = flex_document_attention if backend == "flex" else sdpa_per_segment
    return functools.partial(attend_in_segment_order, kernel, scale=SCALE)


def random_inputs(seq_q, seq_kv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = lambda s: (s, 1, HEADS, HEAD_DIM)  # noqa: E731
    q = torch.randn(shape(seq_q), generator=gen, dtype=torch.float64)
    k, v = (torch.randn(shape(seq_kv), generator=gen, dtype=torch.float64) for _ in range(2))
    return q, k, v, torch.randn(shape(seq_q), generator=gen, dtype=torch.float64)


def reference(kernel, params, q, k, v, grad_out, backward: bool):
    """Single-process output and input gradients for the upstream gradient ``grad_out``."""
    leaves = [t.detach().clone().requires_grad_(backward) for t in (q, k, v)]
    out = kernel(*leaves, params)
    if backward:
        (out * grad_out).sum().backward()
    return out.detach(), [t.grad for t in leaves]


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


class Case(NamedTuple):
    """One comparison: the CP ``strategy`` against the single-process ``kernel`` on the pack ``params``."""

    name: str
    kernel: Callable
    params: PackedSegments
    strategy: Callable


def compare(case: Case, split, inputs, kv_split: bool, backward=True) -> dict:
    """CP output and grads of this rank's tokens vs the reference's rows for them; inputs: (q, k, v, grad_out)."""
    name, kernel, params, strategy = case
    q, k, v, grad_out = inputs
    ref_out, ref_grads = reference(kernel, params, q, k, v, grad_out, backward)
    local = lambda t: split.local(t) if kv_split else t  # noqa: E731
    leaves = [t.detach().clone().requires_grad_(backward) for t in (split.local(q), local(k), local(v))]
    out = strategy(kernel, *leaves)
    result = {f"{name}/out": max_diff(out.detach(), split.local(ref_out))}
    if not backward:
        return result
    (out * split.local(grad_out)).sum().backward()
    dq, dk, dv = (t.grad for t in leaves)
    if not kv_split:  # the unsplit text gets each rank's share of the gradient: sum them
        for grad in (dk, dv):
            torch.distributed.all_reduce(grad, group=split.group)
    result[f"{name}/dq"] = max_diff(dq, split.local(ref_grads[0]))
    result[f"{name}/dk"] = max_diff(dk, local(ref_grads[1]))
    result[f"{name}/dv"] = max_diff(dv, local(ref_grads[2]))
    return result


def self_and_cross_cases() -> dict:
    results = {}
    # Three samples of different lengths, segments padded to multiples of 2*cp = 4.
    q_lens, q_padded = [5, 9, 3], [8, 12, 4]
    for name, kv_lens, kv_padded, is_self in [("self", q_lens, q_padded, True), ("cross", [2, 7, 4], [3, 7, 6], False)]:
        params = segments(q_lens, q_padded, kv_lens, kv_padded, kind=PackedSegments)
        split = LAYOUT.sequence_split(params.cu_seqlens_q_padded)
        inputs = random_inputs(sum(q_padded), sum(kv_padded))
        strategy = local_query_attention(params, split, self_attention=is_self)
        for backend in ("sdpa", "flex"):  # FlexAttention has no CPU backward: forward only
            results |= compare(
                Case(f"{name}/{backend}", kernel_of(backend), params, strategy),
                split,
                inputs,
                kv_split=is_self,
                backward=backend == "sdpa",
            )
    return results


def factorized_cases() -> dict:
    results = {}
    grids = [(3, 1, 3), (1, 2, 4), (2, 2, 2)]  # (t, h, w): an image among videos; 9 tokens pad to 12
    padded = [12, 8, 8]
    offsets = cumulative(padded)
    layout = factorized_params(offsets, grids)
    split = LAYOUT.sequence_split(offsets)
    inputs = random_inputs(sum(padded), sum(padded), seed=1)
    for name, params in (("spatial", layout.spatial), ("temporal", layout.temporal)):
        results |= compare(
            Case(f"ulysses_{name}", kernel_of("sdpa"), params, UlyssesAttention(split, params)),
            split,
            inputs,
            kv_split=True,
        )
    return results


def main(out_dir: Path) -> None:
    initialize_distributed(LAYOUT)
    try:
        results = self_and_cross_cases() | factorized_cases()
        torch.save(results, out_dir / f"rank{torch.distributed.get_rank()}.pt")
    finally:
        destroy_distributed()


if __name__ == "__main__":
    skip_final_gc_at_exit()
    main(Path(sys.argv[1]))
