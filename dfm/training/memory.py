"""Per-rank bytes of parameters, gradients and optimizer state: the formula, and what a built model holds.

``P`` is the number of parameters a rank holds (its TP / PP / EP share), ``D`` the data-parallel x
context-parallel ranks a sharded state is split over. With bf16 parameters, fp32 gradient reduction
(``ddp.grad_reduce_in_fp32``, the default) and Adam (fp32 main weights + two fp32 moments):

| layout | parameters | gradients | optimizer state |
|---|---|---|---|
| DDP | 2P | 4P | 12P |
| distributed optimizer | 2P | 4P | 12P / D |
| Megatron-FSDP ``optim_grads_params`` | 2P / D | 4P / D | 12P / D |

fp32 parameters: 4P; the optimizer then keeps no separate main weights (8P of moments), except under
Megatron-FSDP, which always keeps an fp32 main-weight buffer. Activations and the weights one FSDP unit
gathers for its forward / backward are not in these figures.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from megatron.core.utils import to_local_if_dtensor

from dfm.checkpoint.files import format_bytes
from dfm.parallel.fsdp_shards import inner_model
from dfm.training.faults import grad_buffers

# Which of (parameters, gradients, optimizer state) a data-parallel layout shards.
SHARDED = {
    "ddp": (False, False, False),
    "distributed_optimizer": (False, False, True),
    "no_shard": (False, False, False),
    "optim": (False, False, True),
    "optim_grads": (False, True, True),
    "optim_grads_params": (True, True, True),
}
MOMENT_BYTES = {"adam": 8, "sgd": 4}  # fp32 exp_avg + exp_avg_sq; fp32 momentum
STATE_LOG_KEY = "state bytes per rank:"


@dataclass(frozen=True)
class RankBytes:
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def __add__(self, other: RankBytes) -> RankBytes:
        return RankBytes(self.params + other.params, self.grads + other.grads, self.optimizer + other.optimizer)

    def describe(self) -> str:
        return (
            f"params {format_bytes(self.params)}, grads {format_bytes(self.grads)}, "
            f"optimizer {format_bytes(self.optimizer)} (total {format_bytes(self.total)})"
        )


@dataclass(frozen=True)
class BytesPerParameter:
    params: int
    grads: int
    optimizer: int  # main weights (when kept apart from the parameters) + moments


def layout_name(use_megatron_fsdp: bool, strategy: str, use_distributed_optimizer: bool) -> str:
    """The key of SHARDED for a ``ddp`` config section."""
    if use_megatron_fsdp:
        return strategy
    return "distributed_optimizer" if use_distributed_optimizer else "ddp"


def bytes_per_parameter(precision: str, grad_reduce_in_fp32: bool, optimizer: str, fsdp: bool) -> BytesPerParameter:
    param = 4 if precision == "fp32" else 2
    grad = 4 if grad_reduce_in_fp32 else param
    main = 4 if fsdp or param != 4 else 0  # fp32 main weights apart from the parameters
    return BytesPerParameter(param, grad, main + MOMENT_BYTES[optimizer])


def formula_bytes(count: int, per: BytesPerParameter, layout: str, shards: int) -> RankBytes:
    """The closed form: ``count`` parameters, each sharded state divided by ``shards``."""
    split = [shards if sharded else 1 for sharded in SHARDED[layout]]
    return RankBytes(count * per.params // split[0], count * per.grads // split[1], count * per.optimizer // split[2])


def state_formula(count: int, per: BytesPerParameter, layout: str, shards: int, trainable: int | None = None):
    """``formula_bytes`` with gradients and optimizer state for the ``trainable`` parameters only
    (a LoRA run: the adapters; None: all ``count``). Frozen parameters get neither (megatron's DDP,
    Megatron-FSDP and optimizer skip parameters that do not require grad)."""
    full = formula_bytes(count, per, layout, shards)
    if trainable is None or trainable == count:
        return full
    tuned = formula_bytes(trainable, per, layout, shards)
    return RankBytes(full.params, tuned.grads, tuned.optimizer)


def shape_bytes(shapes: list[tuple[int, ...]], per: BytesPerParameter, layout: str, shards: int) -> RankBytes:
    """Rank 0's bytes from the real parameter shapes: a sharded parameter ``[rows, ...]`` gives each
    rank whole rows (as Megatron-FSDP does), rank 0 the most: ``ceil(rows / shards)``."""
    total = RankBytes(0, 0, 0)
    for shape in shapes:
        rows, width = (shape[0], math.prod(shape[1:])) if shape else (1, 1)
        held = [math.ceil(rows / shards) * width if sharded else rows * width for sharded in SHARDED[layout]]
        total = total + RankBytes(held[0] * per.params, held[1] * per.grads, held[2] * per.optimizer)
    return total


def measured_bytes(model, optimizer, optimizer_name: str) -> RankBytes:
    """What this rank's built chunks and optimizer hold: parameter and gradient buffers, fp32 main
    weights kept apart from the parameters, and the moments the first step allocates (one per
    main-weight element)."""
    params = grads = 0
    model_storages: set[int] = set()
    for chunk in model:
        for weights, chunk_grads in _weights_and_grads(chunk):
            params += sum(_nbytes(t) for t in weights)
            grads += sum(_nbytes(t) for t in chunk_grads)
            model_storages |= {t.untyped_storage().data_ptr() for t in weights}
    main = [to_local_if_dtensor(p) for p in _optimizer_params(optimizer)]
    apart = sum(_nbytes(t) for t in main if t.untyped_storage().data_ptr() not in model_storages)
    return RankBytes(params, grads, apart + sum(t.numel() for t in main) * MOMENT_BYTES[optimizer_name])


def _weights_and_grads(chunk):
    """(parameter tensors, gradient buffers) of a DDP or Megatron-FSDP chunk: under FSDP its buffers
    (shards where sharded), under DDP the module's parameters and its flat gradient buffers."""
    if not chunk.ddp_config.use_megatron_fsdp:
        yield list(chunk.module.parameters()), grad_buffers(chunk)
        return
    for group in chunk.param_and_grad_buffer.parameter_groups:
        weights = [group.model_weight_buffer.data] if group.model_weight_buffer is not None else list(group.params)
        grads = [group.main_grad_buffer.data] if group.main_grad_buffer is not None else []
        yield weights, grads


def _optimizer_params(optimizer) -> list[torch.Tensor]:
    """The tensors megatron's optimizer(s) step: fp32 main weights or the parameters themselves."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [p for part in parts for group in part.optimizer.param_groups for p in group["params"]]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def local_parameter_count(model) -> int:
    """Parameters this rank's chunks hold before any data-parallel sharding (TP / PP / EP share)."""
    return sum(getattr(p, "orig_param", p).numel() for chunk in model for p in inner_model(chunk).parameters())


def trainable_parameter_count(model) -> int:
    """Of ``local_parameter_count``, the parameters that train (all but a LoRA run's frozen base)."""
    return sum(
        getattr(p, "orig_param", p).numel()
        for chunk in model
        for p in inner_model(chunk).parameters()
        if p.requires_grad
    )


def write_memory_record(log_dir: str | None, layout_name_: str, shards: int, counts, per: BytesPerParameter) -> None:
    """``{"layout", "shards", "ranks": [{"parameters", "measured": {params, grads, optimizer},
    "formula": {...}}]}``: what each rank holds next to the closed form for its parameter count."""
    if not log_dir:
        return
    ranks = [
        {
            "parameters": count,
            "trainable": trainable,
            "measured": asdict(held),
            "formula": asdict(state_formula(count, per, layout_name_, shards, trainable)),
        }
        for held, count, trainable in counts
    ]
    record = {"layout": layout_name_, "shards": shards, "ranks": ranks}
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    (Path(log_dir) / "memory_per_rank.json").write_text(json.dumps(record, indent=1))
