"""Layout-independent parameter initialisation.

Every parameter is drawn as its *full* (unsharded) tensor from a generator seeded by
(seed, global parameter name), then this rank keeps its shard. So TP/PP/EP layouts start
from exactly the weights of the single-process model: the base of our equality tests.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable

import torch
from megatron.core import parallel_state
from torch import nn

# adaLN-Zero (DiT) plus the cross-attention output (PixArt): every fresh block is the identity.
ZERO_INIT = re.compile(r"(adaln\.linear\.|final_layer\.(adaln|linear)\.|cross_attention\.linear_proj\.)")


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


def default_rule(name: str, shape: list[int], generator: torch.Generator, std: float) -> torch.Tensor:
    """DiT-style init: zeros for adaLN / final layer / biases, ones for norms, xavier for matrices."""
    full = torch.empty(shape)
    if ZERO_INIT.search(name) or name.endswith("bias"):
        return full.zero_()
    if len(shape) == 1:
        return full.fill_(1.0)
    if "embed" in name and "tables" in name or "t_embedder" in name:
        return full.normal_(0.0, std, generator=generator)
    fan_out, fan_in = shape[0], int(torch.tensor(shape[1:]).prod())
    bound = (6.0 / (fan_in + fan_out)) ** 0.5
    return full.uniform_(-bound, bound, generator=generator)


@torch.no_grad()
def init_params(
    model: nn.Module,
    seed: int,
    global_name: Callable[[str], str],
    std: float = 0.02,
    rule: Callable[..., torch.Tensor] = default_rule,
) -> None:
    """Fill every parameter of ``model`` from (seed, global_name(name))."""
    for name, param in model.named_parameters():
        gname = global_name(name)
        generator = torch.Generator().manual_seed(name_seed(seed, gname))
        full = rule(gname, full_shape(param), generator, std)
        param.copy_(take_shard(full, param).to(param.dtype))
