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


def l2_grad_norm_alone_skips_the_reduce(original):
    """megatron's ``get_grad_norm_fp32`` for the L2 norm of plain (not DTensor) gradients: the same norm
    (``l2_norm_impl``, squared, summed over the group, its square root), with the all-reduce left out where
    the group is this one rank (a gloo call of ~0.1 ms on the CPU) and no ``no_grad`` block per gradient
    (``to_local_if_dtensor``'s, ~2 us each). Other norms and DTensor gradients (Megatron-FSDP) go to megatron's."""
    import megatron.core.optimizer.clip_grads as clip_grads
    from torch.distributed.tensor import DTensor

    def get_grad_norm_fp32(grads_for_norm, norm_type=2, grad_stats_parallel_group=None):
        if isinstance(grads_for_norm, torch.Tensor):
            grads_for_norm = [grads_for_norm]
        if float(norm_type) != 2.0 or any(isinstance(grad, DTensor) for grad in grads_for_norm):
            return original(grads_for_norm, norm_type, grad_stats_parallel_group)
        if grads_for_norm:
            flag = torch.zeros(1, dtype=torch.int)
            grad_norm, _ = clip_grads.multi_tensor_applier(clip_grads.l2_norm_impl, flag, [grads_for_norm], False)
        else:
            grad_norm = torch.zeros(1, dtype=torch.float)
        total_norm = grad_norm**2.0
        if torch.distributed.get_world_size(grad_stats_parallel_group) > 1:
            torch.distributed.all_reduce(total_norm, op=torch.distributed.ReduceOp.SUM, group=grad_stats_parallel_group)
        return total_norm.item() ** 0.5

    return get_grad_norm_fp32


def clip_checking_dtypes(original):
    """megatron's ``clip_grad_by_total_norm_fp32`` (grads scaled in place by max_norm / (total_norm + 1e-6)
    when that is below 1, as its ``local_multi_tensor_scale`` does), the fp32 check made on the dtype:
    megatron asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``, which a CPU gradient fails. Nothing
    is walked when there is nothing to scale (megatron checks every gradient's type first, ~0.3 ms a step)."""
    from torch.distributed.tensor import DTensor

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff >= 1.0:
            return
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        allowed = (torch.float32, torch.bfloat16) if use_decoupled_grad else (torch.float32,)
        grads = []
        for param in parameters:
            grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
            if grad is not None:
                assert grad.dtype in allowed, f"gradient of dtype {grad.dtype}, not one of {allowed}"
                grads.append((grad.to_local() if isinstance(grad, DTensor) else grad).detach())
        torch._foreach_mul_(grads, clip_coeff)

    return clip_grad_by_total_norm_fp32
