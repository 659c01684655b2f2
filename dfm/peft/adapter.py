"""A LoRA adapter on one (tensor-parallel) linear: y = W x + scaling * B A x, per diffusers part.

The adapter is split over TP the way its base weight is, so each rank computes exactly its share:

* column-parallel base (W [out/tp, in]): A [r, in] replicated, B [out/tp, r] split like W's rows.
  x is the whole input (gathered first under SP, whose backward then only takes this rank's
  tokens, since the gradient is already whole); A x is the same on every rank and its gradient is
  summed over TP (each rank's B sees its rows only), so A's gradient is whole on every rank.
* row-parallel base (W [out, in/tp]): A [r, in/tp] split like W's columns, B [out, r] replicated.
  A x is summed over TP (as W x is), then B; under SP this rank keeps its tokens of B A x.
* a plain ``nn.Linear`` (replicated): no communication.

A fused base (megatron's linear_qkv holds to_q, to_k and to_v) has one (A, B) per diffusers part;
each part's B rows go to the part's rows of the fused output (``order``), untargeted parts add 0.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from torch import Tensor, nn

from dfm.models.common.init import take_shard, zero_init
from dfm.peft.errors import PeftError

COLUMN, ROW, PLAIN = "column", "row", "plain"
# Attributes megatron's gradient reductions read, carried from a replicated base weight to its adapter.
REDUCTION_ATTRIBUTES = ("sequence_parallel", "pipeline_parallel")


def linear_kind(module: nn.Module) -> str | None:
    """'column' / 'row' for megatron's (or Transformer Engine's) parallel linears, 'plain' for nn.Linear."""
    if "LayerNorm" in type(module).__name__:
        raise PeftError(f"{type(module).__name__}: LoRA on a linear with a fused input norm is not supported")
    if isinstance(module, ColumnParallelLinear) or getattr(module, "parallel_mode", None) == "column":
        return COLUMN
    if isinstance(module, RowParallelLinear) or getattr(module, "parallel_mode", None) == "row":
        return ROW
    return PLAIN if isinstance(module, nn.Linear) else None


class LoraAdapter(nn.Module):
    """The adapter of one base linear. ``part_rows``: per diffusers part, the full-weight rows it
    occupies (dfm/peft/targets.py); ``targeted``: which parts get (A, B). Parameters ``A.<s>``,
    ``B.<s>`` (s: the part's index in the rule), full shapes A [r, in], B [n_s, r]."""

    def __init__(
        self, base: nn.Module, kind: str, part_rows: list[Tensor], targeted, rank: int, scaling: float, dropout: float
    ):
        super().__init__()
        self.kind, self.scaling, self.rank = kind, scaling, rank
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.sequence_parallel = bool(getattr(base, "sequence_parallel", False)) and kind != PLAIN
        self.gather_output = bool(getattr(base, "gather_output", False))
        if kind == ROW and len(part_rows) > 1:
            raise PeftError("LoRA on a row-parallel linear fused from several modules is not supported")
        stride = getattr(base.weight, "partition_stride", 1)
        tp = parallel_state.get_tensor_model_parallel_world_size() if kind == COLUMN else 1
        self.part_sizes = [len(rows) for rows in part_rows]
        self.A, self.B = nn.ParameterDict(), nn.ParameterDict()
        for index, (rows, hit) in enumerate(zip(part_rows, targeted)):
            if hit:
                self.A[str(index)], self.B[str(index)] = self._pair(base, kind, len(rows) // tp, stride, len(part_rows))
        zero_init(self.B)  # B = 0: a fresh adapter leaves the model unchanged
        # Not a buffer: index values must survive a meta build's to_empty(); moved to x's device once.
        self.order = self._local_order(part_rows, base)

    def _pair(
        self, base: nn.Module, kind: str, rows: int, stride: int, parts: int
    ) -> tuple[nn.Parameter, nn.Parameter]:
        """This rank's (A [r, local in], B [local rows, r]), tagged with how TP splits them."""
        like = dict(dtype=base.weight.dtype, device=base.weight.device)
        a = nn.Parameter(torch.empty(self.rank, base.weight.shape[1], **like))
        b = nn.Parameter(torch.empty(rows, self.rank, **like))
        if kind == ROW:  # A's columns split as W's
            set_tensor_model_parallel_attributes(a, True, 1, stride)
        if kind == COLUMN:  # B's rows split as W's (a fused weight's parts each split evenly)
            set_tensor_model_parallel_attributes(b, True, 0, stride if parts == 1 else 1)
        for param in (a, b):
            for name in REDUCTION_ATTRIBUTES:
                if kind == PLAIN and getattr(base.weight, name, False):
                    setattr(param, name, True)
        return a, b

    def _local_order(self, part_rows: list[Tensor], base: nn.Module) -> Tensor | None:
        """Index into cat(local part outputs) giving this rank's base output rows in order; None: identity."""
        if len(part_rows) == 1 and torch.equal(part_rows[0], torch.arange(len(part_rows[0]))):
            return None  # W's own rows: B is split as W, its local rows are W's local rows
        full = torch.cat(part_rows)  # cat(parts)[j] is full row full[j]
        position = torch.empty_like(full)
        position[full] = torch.arange(len(full))  # full row -> its place in cat(parts)
        column = self.kind == COLUMN
        tp = parallel_state.get_tensor_model_parallel_world_size() if column else 1
        rank = parallel_state.get_tensor_model_parallel_rank() if column else 0
        local_rows = take_shard(torch.arange(len(full)), base.weight) if column else torch.arange(len(full))
        # Each part's local rows are its rank-th contiguous chunk; where they sit in cat(local parts):
        sizes = torch.tensor(self.part_sizes)
        starts, local_starts = sizes.cumsum(0) - sizes, (sizes // tp).cumsum(0) - sizes // tp
        at = position[local_rows]
        part = torch.bucketize(at, starts, right=True) - 1
        within = at - starts[part] - rank * (sizes[part] // tp)
        if ((within < 0) | (within >= sizes[part] // tp)).any():
            raise PeftError("a fused linear whose parts do not split evenly over TP: no LoRA there")
        return local_starts[part] + within

    def forward(self, x: Tensor) -> Tensor:
        """x: the base linear's input -> what to add to its output (same shape)."""
        if self.kind == COLUMN and self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
        x = self.dropout(x)
        keys = list(self.A.keys())
        h = torch.nn.functional.linear(x, torch.cat([self.A[k] for k in keys]))  # [.., r * parts]
        if self.kind == COLUMN:
            h = copy_to_tensor_model_parallel_region(h)
        elif self.kind == ROW:
            h = reduce_from_tensor_model_parallel_region(h)
        y = self._expand(h, keys) * self.scaling
        if self.kind == ROW and self.sequence_parallel:
            y = scatter_to_sequence_parallel_region(y)
        if self.kind == COLUMN and self.gather_output:
            y = gather_from_tensor_model_parallel_region(y)
        return y

    def _expand(self, h: Tensor, keys: list[str]) -> Tensor:
        """Each targeted part's B on its slice of h, zeros for the others, in the base's row order."""
        tp = parallel_state.get_tensor_model_parallel_world_size() if self.kind == COLUMN else 1
        hs = dict(zip(keys, h.split(self.rank, dim=-1)))
        outs = [
            hs[str(i)] @ self.B[str(i)].t() if str(i) in hs else h.new_zeros(*h.shape[:-1], size // tp)
            for i, size in enumerate(self.part_sizes)
        ]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if self.order is None:
            return y
        if self.order.device != y.device:
            self.order = self.order.to(y.device)
        return y.index_select(-1, self.order)


def add_output(module: nn.Module, inputs: tuple, output):
    """Forward hook on the base linear: its output (or (output, bias)) plus the adapter's."""
    delta = module.lora(inputs[0])
    if isinstance(output, tuple):
        return (output[0] + delta, *output[1:])
    return output + delta
