"""Layout-independent parameter initialisation.

Every parameter's value is that of its *full* (unsharded) tensor drawn from a generator seeded by
(seed, global parameter name), of which this rank keeps its shard. So TP/PP/EP/FSDP layouts start
from exactly the weights of the single-process model: the base of our equality tests. The full
tensor is drawn a chunk of rows at a time, keeping only this rank's rows (``fill_initial``), so no
rank ever holds more than its shard plus one chunk.

What is drawn is DiT's init: zeros for biases, ones for norm weights, xavier-uniform for
matrices, unless the module declares otherwise where it is built (``zero_init``: adaLN-Zero, the
final layer, the cross-attention output; ``normal_init``: the timestep MLP, learned embeddings).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, set_tensor_model_parallel_attributes
from torch import nn

# The initialiser a module declares for its parameters, kept on each parameter.
DECLARED_INIT = "dfm_init"
ZEROS, NORMAL = "zeros", "normal"


def zero_init(module: nn.Module) -> nn.Module:
    """Declare every parameter of ``module`` zero-initialised (adaLN-Zero: a fresh block is the identity)."""
    return _declare(module, ZEROS)


def normal_init(module: nn.Module) -> nn.Module:
    """Declare ``module``'s matrices drawn from N(0, std^2) (std: the model's init_method_std), not xavier."""
    return _declare(module, NORMAL)


def _declare(module: nn.Module, kind: str) -> nn.Module:
    for param in module.parameters():
        setattr(param, DECLARED_INIT, kind)
    return module


def name_seed(seed: int, name: str) -> int:
    return zlib.crc32(f"{seed}:{name}".encode()) & 0x7FFFFFFF


def full_shape(param: torch.Tensor) -> list[int]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= parallel_state.get_tensor_model_parallel_world_size()
    return shape


def take_shard(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This TP rank's shard of ``full``, matching megatron's strided split."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    chunks = torch.chunk(full, tp * stride, dim=dim)
    return torch.cat(chunks[rank::tp], dim=dim)


def gather_full(shard: torch.Tensor) -> torch.Tensor:
    """The inverse of ``take_shard``: the full tensor from every TP rank's shard (collective over TP)."""
    if not getattr(shard, "tensor_model_parallel", False):
        return shard.detach()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    dim, stride = shard.partition_dim, getattr(shard, "partition_stride", 1)
    shards = [torch.empty_like(shard) for _ in range(tp)]
    torch.distributed.all_gather(
        shards, shard.detach().contiguous(), group=parallel_state.get_tensor_model_parallel_group()
    )
    # Rank r holds chunks r, r + tp, r + 2 tp, ... of the full tensor (one per stride step).
    pieces = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([pieces[rank][step] for step in range(stride) for rank in range(tp)], dim=dim)


# Bytes the drawing of initial values works in (at least 16 rows at a time): while it initialises,
# a rank holds its share plus this.
CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class TensorSplit:
    """How megatron splits a full tensor over TP: ``rank`` holds chunks rank, rank + tp, ... of the
    ``tp * stride`` equal chunks along ``dim`` (see ``take_shard``)."""

    dim: int
    stride: int
    tp: int
    rank: int


def tensor_split(param: torch.Tensor) -> TensorSplit | None:
    """This TP rank's split of ``param``'s full tensor, None when it holds all of it."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    return TensorSplit(param.partition_dim, getattr(param, "partition_stride", 1), tp, rank)


def initial_kind(name: str, declared: str | None, shape: list[int]) -> str | float:
    """The constant a parameter starts at, or the distribution it is drawn from ('normal', 'uniform')."""
    if declared == ZEROS or name.endswith("bias"):
        return 0.0
    if len(shape) == 1:
        return 1.0
    return NORMAL if declared == NORMAL else "uniform"


def _draw(block: torch.Tensor, kind: str, shape: list[int], generator: torch.Generator, std: float) -> None:
    if kind == NORMAL:
        block.normal_(0.0, std, generator=generator)
        return
    fan_out, fan_in = shape[0], math.prod(shape[1:])
    bound = (6.0 / (fan_in + fan_out)) ** 0.5
    block.uniform_(-bound, bound, generator=generator)


def _local_row_runs(rows: int, split: TensorSplit | None) -> list[tuple[int, int]]:
    """The full tensor's row ranges ``[start, stop)`` whose rows, in order, are this rank's rows."""
    if split is None or split.dim != 0:
        return [(0, rows)]
    size = -(-rows // (split.tp * split.stride))  # torch.chunk's chunk size
    starts = range(split.rank * size, rows, split.tp * size)
    return [(start, min(start + size, rows)) for start in starts]


def _rows_per_chunk(row_numel: int) -> int:
    """Rows drawn at once: the fp32 rows, this rank's columns of them and their copy in the model's
    dtype within CHUNK_BYTES, a multiple of 16 elements so that chunked ``normal_`` (which transforms
    16 values at a time) gives the values of one call over the whole tensor."""
    align = 16 // math.gcd(row_numel, 16)
    return max(align, CHUNK_BYTES // (3 * 4 * row_numel) // align * align)


@dataclass(frozen=True)
class InitialValue:
    """What decides parameter ``name``'s initial value: its declared kind, full shape, the run's seed and std."""

    name: str
    declared: str | None
    shape: list[int]
    seed: int
    std: float


@torch.no_grad()
def fill_initial(
    out: torch.Tensor, value: InitialValue, split: TensorSplit | None, rows: range, dtype: torch.dtype | None = None
) -> None:
    """Fill ``out`` ``[len(rows), ...]`` with rows ``rows`` of this rank's shard of parameter ``value.name``'s
    initial value (full ``shape``), rounded through ``dtype`` if given: bit for bit the full tensor
    drawn from (seed, name) in one call and sliced, but drawn within CHUNK_BYTES. Rows before
    the last wanted one are drawn into the reused chunk and dropped (the stream is sequential)."""
    name, shape, seed, std = value.name, value.shape, value.seed, value.std
    kind = initial_kind(name, value.declared, shape)
    if not isinstance(kind, str):
        out.fill_(kind)
        return
    generator = torch.Generator().manual_seed(name_seed(seed, name))
    row_numel = math.prod(shape[1:])
    per_chunk = _rows_per_chunk(row_numel)
    scratch = torch.empty(min(per_chunk + 15 // row_numel, shape[0]), *shape[1:])  # + the tail rows
    wanted = _wanted_runs(_local_row_runs(shape[0], split), rows)
    start, last = 0, max((stop for _, stop, _ in wanted), default=0)
    while start < last:
        stop = min(shape[0], start + per_chunk)
        if (shape[0] - stop) * row_numel < 16:  # normal_ redraws a tensor's last 16 values: one call
            stop = shape[0]
        block = scratch[: stop - start]
        _draw(block, kind, shape, generator, std)
        _place(out, block if dtype is None else block.to(dtype), start, stop, wanted, split)
        start = stop


def _wanted_runs(runs: list[tuple[int, int]], rows: range) -> list[tuple[int, int, int]]:
    """(full start, full stop, its row in ``out``) for the local rows ``rows``: ``runs`` hold the
    full tensor's row ranges of this rank's rows, in order."""
    wanted, local = [], 0
    for start, stop in runs:
        lo, hi = max(local, rows.start), min(local + stop - start, rows.stop)
        if lo < hi:
            wanted.append((start + lo - local, start + hi - local, lo - rows.start))
        local += stop - start
    return wanted


def _place(out: torch.Tensor, block: torch.Tensor, start: int, stop: int, wanted, split) -> None:
    """Copy the wanted rows of ``block`` (full rows ``[start, stop)``) into ``out``, only this rank's
    columns when TP splits a later dimension."""
    for first, end, at in wanted:
        lo, hi = max(first, start), min(end, stop)
        if lo >= hi:
            continue
        rows = block[lo - start : hi - start]
        if split is not None and split.dim != 0:
            chunks = torch.chunk(rows, split.tp * split.stride, dim=split.dim)
            rows = torch.cat(chunks[split.rank :: split.tp], dim=split.dim)
        out[at + lo - first : at + hi - first].copy_(rows)


def mark_tensor_parallel_weights(model: nn.Module) -> None:
    """Tag megatron's parallel-linear weights as TP shards (dim, stride), as megatron itself does
    only when it initialises them (``perform_initialization``); we initialise here instead.
    Without the tags a TP rank's weight looks replicated: it would be drawn as if it were the
    full tensor, and its gradient left out of the grad norm."""
    for name, module in model.named_modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or module.weight is None:
            continue
        if hasattr(module.weight, "tensor_model_parallel"):
            continue
        dim = 0 if isinstance(module, ColumnParallelLinear) else 1
        # megatron's MLP builds a gated fc1 with stride 2: each rank holds [gate_r; up_r].
        stride = 2 if name.endswith("linear_fc1") and module.config.gated_linear_unit else 1
        set_tensor_model_parallel_attributes(module.weight, True, dim, stride)


@torch.no_grad()
def init_params(model: nn.Module, seed: int, global_name: Callable[[str], str], std: float = 0.02) -> None:
    """Fill every parameter of ``model`` (materialised, TP-local) from (seed, global_name(name))."""
    mark_tensor_parallel_weights(model)
    for name, param in model.named_parameters():
        value = InitialValue(global_name(name), getattr(param, DECLARED_INIT, None), full_shape(param), seed, std)
        fill_initial(param, value, tensor_split(param), range(param.shape[0] if param.dim() else 1))
