"""The block linears' matrix products in FP8 (``mixed_precision.fp8``), by torch's ``_scaled_mm``.

Tensor-wise current scaling, Transformer Engine's ``Float8CurrentScaling`` recipe without TE: every
product quantizes its operands just before it, each scaled so that its absolute maximum lands on the
format's largest value. Forward operands (input, weight) are E4M3; the output gradient is E5M2
(``hybrid``, the wider range that gradients need) or E4M3 (``e4m3``). Products accumulate in fp32 and
come out in the input's dtype; the weight gradient in the weight's.

Layouts: each amax is reduced (max) over the tensor-and-context-parallel group, the ranks that hold
pieces of one tensor (a TP shard of a weight, of a row-parallel input or a column-parallel output
gradient, a CP rank's tokens), so every rank quantizes as one process would. Parameters, attention,
norms and the optimizer keep their precision; only these products change.

``_scaled_mm`` takes its first operand row-major and its second column-major, with the shared and
output dimensions multiples of 16 on CUDA: linears of other sizes keep their precision
(``fp8_shapes_ok``); the weight gradient's shared dimension, the tokens, is zero-padded to 16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MULTIPLE = 16  # cuBLAS's FP8 GEMMs: shared and output dimensions in multiples of 16
AMAX_FLOOR = 1e-12


@dataclass(frozen=True)
class Fp8Recipe:
    """Formats of the forward operands and of the output gradient."""

    forward: torch.dtype = E4M3
    gradient: torch.dtype = E5M2

    @classmethod
    def named(cls, name: str) -> Fp8Recipe:
        """``hybrid`` (E4M3 forward, E5M2 gradients) or ``e4m3`` (E4M3 everywhere), TE's names."""
        formats = {"hybrid": E5M2, "e4m3": E4M3}
        if name not in formats:
            raise ValueError(f"mixed_precision.fp8={name!r}: expected one of {sorted(formats)}")
        return cls(E4M3, formats[name])


def fp8_shapes_ok(in_features: int, out_features: int) -> bool:
    """Both sides of a (per-partition) weight ``[out, in]`` are multiples of 16."""
    return in_features % FP8_MULTIPLE == 0 and out_features % FP8_MULTIPLE == 0


def quantize(x: Tensor, dtype: torch.dtype, group: dist.ProcessGroup | None) -> tuple[Tensor, Tensor]:
    """``x`` -> (x in ``dtype`` scaled so that amax maps to the format's largest value, the fp32 [] inverse
    scale that undoes it). ``group``: the ranks whose pieces of ``x`` share one amax (None: this rank alone)."""
    largest = torch.finfo(dtype).max
    x = x.detach()
    # Three passes over x's size, none in fp32: the max of |x| without an |x| tensor, the scaled copy in x's
    # dtype, clamped in place (a value past the largest casts to inf in E5M2, and saturating is not promised).
    amax = torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32)
    if group is not None:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    scale = largest / amax.clamp(min=AMAX_FLOOR)  # an all-zero tensor: zeros, not 0 * inf
    quantized = (x * scale).clamp_(-largest, largest).to(dtype)
    # Row-major whatever x's strides (an incoming gradient may be a transposed view): cuBLAS's first operand.
    return quantized.contiguous(), scale.reciprocal()


def column_major(x: Tensor) -> Tensor:
    """[m, n] with strides (1, m): the layout ``_scaled_mm`` wants of its second operand."""
    return x.t().contiguous().t()


def tokens_padded_t(x: Tensor) -> Tensor:
    """[t, n] -> its transpose [n, t'] row-major, t' = t rounded up to 16 (zero columns): the weight
    gradient's shared dimension."""
    tokens = x.shape[0]
    if tokens % FP8_MULTIPLE == 0:
        return x.t().contiguous()
    padded = -(-tokens // FP8_MULTIPLE) * FP8_MULTIPLE
    out = x.new_zeros(x.shape[1], padded)
    out[:, :tokens] = x.t()
    return out


def scaled_mm(a: Tensor, a_inv: Tensor, b: Tensor, b_inv: Tensor, out_dtype: torch.dtype) -> Tensor:
    return torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype)


class Fp8Matmul(torch.autograd.Function):
    """x [t, in] @ weight[out, in]^T -> [t, out] with both products of the backward in FP8 too. Keeps the
    quantized input and weight (1 byte an element) for the backward, not their originals."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, recipe: Fp8Recipe, group: dist.ProcessGroup | None) -> Tensor:
        xq, x_inv = quantize(x, recipe.forward, group)
        wq, w_inv = quantize(weight, recipe.forward, group)
        ctx.save_for_backward(xq, x_inv, wq, w_inv)
        ctx.recipe, ctx.group, ctx.weight_dtype = recipe, group, weight.dtype
        return scaled_mm(xq, x_inv, wq.t(), w_inv, x.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        xq, x_inv, wq, w_inv = ctx.saved_tensors
        gq, g_inv = quantize(grad, ctx.recipe.gradient, ctx.group)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = scaled_mm(gq, g_inv, column_major(wq), w_inv, grad.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = scaled_mm(tokens_padded_t(gq), g_inv, tokens_padded_t(xq).t(), x_inv, ctx.weight_dtype)
        return grad_x, grad_w, None, None


def fp8_linear(
    x: Tensor, weight: Tensor, bias: Tensor | None, recipe: Fp8Recipe, group: dist.ProcessGroup | None
) -> Tensor:
    """x [..., in] -> [..., out]: ``x @ weight^T`` in FP8 (``Fp8Matmul``), plus ``bias`` in x's dtype."""
    out = Fp8Matmul.apply(x.reshape(-1, x.shape[-1]), weight, recipe, group)
    out = out.view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


def fp8_recipe_of(linear) -> Fp8Recipe | None:
    """The recipe ``linear`` (a megatron parallel linear) runs its products in, or None (its own
    precision): decided on the first call and kept on the module. None unless the run asks for fp8
    (``config.fp8_linears``) and the module's class takes it (``fp8_capable``: not adaLN's rows); linears
    under megatron's expert communication, deferred weight gradients or sizes off 16 keep their precision."""
    if "_fp8_recipe" not in linear.__dict__:
        linear._fp8_recipe = fp8_recipe_for(linear)
    return linear._fp8_recipe


def fp8_recipe_for(linear) -> Fp8Recipe | None:
    config = linear.config
    name = getattr(config, "fp8_linears", None)
    if name is None or not getattr(linear, "fp8_capable", False) or linear.weight is None:
        return None
    if (
        getattr(linear, "explicit_expert_comm", False)
        or getattr(linear, "disable_grad_reduce", False)
        or linear.gradient_accumulation_fusion
        or config.defer_embedding_wgrad_compute
    ):
        return None
    # The partition's sizes as megatron declares them (under Megatron-FSDP ``weight`` is a shard between steps).
    in_features = getattr(linear, "input_size_per_partition", linear.input_size)
    out_features = getattr(linear, "output_size_per_partition", linear.output_size)
    return Fp8Recipe.named(name) if fp8_shapes_ok(in_features, out_features) else None


def amax_group(linear) -> dist.ProcessGroup | None:
    """The ranks holding pieces of one of the linear's tensors: TP, and CP's token shards with it; None when
    that is this rank alone. Kept on the module after the first call: no group size asked per product."""
    if "_fp8_amax_group" not in linear.__dict__:
        from megatron.core import parallel_state

        split_tokens = (
            parallel_state.model_parallel_is_initialized() and parallel_state.get_context_parallel_world_size() > 1
        )
        group = parallel_state.get_tensor_and_context_parallel_group() if split_tokens else linear.tp_group
        linear._fp8_amax_group = group if group is not None and dist.get_world_size(group) > 1 else None
    return linear._fp8_amax_group


def fp8_column_forward(linear, x: Tensor, recipe: Fp8Recipe) -> Tensor:
    """ColumnParallelLinear's forward with its product in FP8: x [s, b, in] -> [s, b, out / tp] (all of
    it with ``gather_output``), the bias added."""
    from megatron.core.tensor_parallel import mappings

    if linear.sequence_parallel:
        x = mappings.gather_from_sequence_parallel_region(x, group=linear.tp_group)
    else:
        x = mappings.copy_to_tensor_model_parallel_region(x, group=linear.tp_group)
    out = fp8_linear(x, linear.weight, linear.bias, recipe, amax_group(linear))
    if linear.gather_output:
        out = mappings.gather_from_tensor_model_parallel_region(out, group=linear.tp_group)
    return out


def fp8_row_forward(linear, x: Tensor, recipe: Fp8Recipe) -> Tensor:
    """RowParallelLinear's forward with its product in FP8: x [s, b, in / tp] -> [s, b, out] (reduced, or
    reduce-scattered over SP ranks), the bias added."""
    from megatron.core.tensor_parallel import mappings

    if not linear.input_is_parallel:
        x = mappings.scatter_to_tensor_model_parallel_region(x, group=linear.tp_group)
    out = fp8_linear(x, linear.weight, None, recipe, amax_group(linear))
    if linear.sequence_parallel:
        out = mappings.reduce_scatter_to_sequence_parallel_region(out, group=linear.tp_group)
    else:
        out = mappings.reduce_from_tensor_model_parallel_region(out, group=linear.tp_group)
    return out if linear.bias is None else out + linear.bias


def check_fp8_device(fp8: str | None, device: torch.device | str) -> None:
    """FP8 products need a GPU with FP8 tensor cores (compute capability 8.9: Ada, Hopper and later); the
    CPU runs torch's reference kernels (slow: for tests)."""
    device = torch.device(device)
    if fp8 is None or device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise ValueError(
            f"mixed_precision.fp8={fp8!r} needs FP8 tensor cores (compute capability >= 8.9); "
            f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}"
        )


def fp8_coverage(chunks) -> tuple[list[str], list[str]]:
    """(the linears of ``chunks`` whose products run in FP8, dfm's linears that keep their precision), by
    module name."""
    in_fp8, kept = [], []
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if hasattr(module, "fp8_capable"):
                (in_fp8 if fp8_recipe_of(module) is not None else kept).append(name)
    return in_fp8, kept
