"""megatron's MoE router and alltoall dispatcher without Transformer Engine, on CPU."""

from __future__ import annotations

import functools

import torch

from dfm.platform.compat.patch import MISSING


def none_if_missing(original):
    """``te_general_gemm`` is bound only when Transformer Engine imports, yet the router tests
    ``te_general_gemm is not None``: bind it to None so the router uses torch matmuls."""
    return None if original is MISSING else original


def split_sizes_as_numpy(original):
    """Wraps ``maybe_move_tensor_to_cpu``, which converts only CUDA tensors: the alltoall split sizes
    it is asked for "as numpy" would stay tensors on CPU, and ``all_to_all_single`` rejects them."""

    @functools.wraps(original)
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return maybe_move_tensor_to_cpu
