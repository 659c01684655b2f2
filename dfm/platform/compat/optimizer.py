"""megatron's optimizer classifies parameters by their CUDA type name.

``Float16OptimizerWithFloat16Params.__init__``, ``DistributedOptimizer._build_model_and_main_param_groups``
and ``clip_grad_by_total_norm_fp32`` compare ``param.type()`` with ``'torch.cuda.FloatTensor'``
(``HalfTensor``, ``BFloat16Tensor``) and reject CPU parameters. Only the dtype part of that name
matters to them, so during their calls CPU tensors report the CUDA name of their dtype.
"""

from __future__ import annotations

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
