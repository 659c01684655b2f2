"""megatron's optimizer classifies parameters by their CUDA type name, and its fallback gradient norm
reads every gradient's norm to the host.

``Float16OptimizerWithFloat16Params.__init__``, ``DistributedOptimizer._build_model_and_main_param_groups``
and ``clip_grad_by_total_norm_fp32`` compare ``param.type()`` with ``'torch.cuda.FloatTensor'``
(``HalfTensor``, ``BFloat16Tensor``) and reject CPU parameters. Only the dtype part of that name
matters to them, so during their calls CPU tensors report the CUDA name of their dtype.

Without Apex or Transformer Engine, ``get_grad_norm_fp32`` takes ``local_multi_tensor_l2_norm``: a
``torch.norm`` per gradient, then ``torch.tensor`` of those 0-d tensors (a host read of each: a device
sync per parameter on a GPU) and the norm of that. ``foreach_l2_norm`` gives the same numbers from one
``_foreach_norm`` (the same per-tensor kernel) and a stack, with no host read.
"""

from __future__ import annotations

import torch

from dfm.platform.compat.devices import running_inside, tensor_method_replaced


def _cuda_named_type(original):
    def type_with_cuda_name(tensor, dtype=None, non_blocking=False, **kwargs):
        if dtype is not None:
            return original(tensor, dtype, non_blocking, **kwargs)
        name = original(tensor)
        if tensor.device.type == "cpu" and name.startswith("torch.") and "cuda" not in name:
            return "torch.cuda." + name[len("torch.") :]
        return name

    return type_with_cuda_name


def cuda_type_names():
    """Let ``Tensor.type()`` report CPU tensors under their CUDA names for the ``with`` block."""
    return tensor_method_replaced("type", _cuda_named_type)


def with_cuda_type_names(original):
    """Wrap a function (or a classmethod) so it runs inside ``cuda_type_names()``."""
    return running_inside(cuda_type_names, original)


def multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """``local_multi_tensor_l2_norm``'s result ([1] fp32 tensor, None) without a host read per tensor."""
    tensors = [t for group in tensor_lists for t in group]
    if not tensors:
        return torch.zeros(1, dtype=torch.float), None
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors)))
    return total.reshape(1).to(torch.float), None


def foreach_l2_norm(original):
    """megatron's local fallback -> ``multi_tensor_l2_norm``; a fused kernel (Apex, TE) stays."""
    from megatron.core.utils import local_multi_tensor_l2_norm

    return multi_tensor_l2_norm if original is local_multi_tensor_l2_norm else original
