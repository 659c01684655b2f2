"""Layout-independent parameter initialisation.

Every parameter is drawn as its *full* (unsharded) tensor from a generator seeded by
(seed, global parameter name), then this rank keeps its shard. So TP/PP/EP layouts start
from exactly the weights of the single-process model: the base of our equality tests.

What is drawn is DiT's init: zeros for biases, ones for norm weights, xavier-uniform for
matrices, unless the module declares otherwise where it is built (``zero_init``: adaLN-Zero, the
final layer, the cross-attention output; ``normal_init``: the timestep MLP, learned embeddings).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

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


def initial_value(name: str, declared: str | None, shape: list[int], generator: torch.Generator, std: float):
    """The full tensor of parameter ``name`` of ``shape``: what its module ``declared``, else by kind."""
    full = torch.empty(shape)
    if declared == ZEROS or name.endswith("bias"):
        return full.zero_()
    if len(shape) == 1:
        return full.fill_(1.0)
    if declared == NORMAL:
        return full.normal_(0.0, std, generator=generator)
    fan_out, fan_in = shape[0], int(torch.tensor(shape[1:]).prod())
    bound = (6.0 / (fan_in + fan_out)) ** 0.5
    return full.uniform_(-bound, bound, generator=generator)


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
    """Fill every parameter of ``model`` from (seed, global_name(name))."""
    mark_tensor_parallel_weights(model)
    for name, param in model.named_parameters():
        gname = global_name(name)
        generator = torch.Generator().manual_seed(name_seed(seed, gname))
        full = initial_value(gname, getattr(param, DECLARED_INIT, None), full_shape(param), generator, std)
        param.copy_(take_shard(full, param).to(param.dtype))
