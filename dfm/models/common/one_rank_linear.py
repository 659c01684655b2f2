"""megatron's parallel linears, run as one ``F.linear`` where nothing is parallel.

On one tensor-parallel rank megatron's ColumnParallelLinear / RowParallelLinear still go through a
Python autograd Function (``LinearWithGradAccumulationAndAsyncCommunication``): a matmul, then the
bias added in a pass of its own, or handed back (``skip_bias_add``) for the caller to add in another
pass over [s, b, out]. Here the same parameters go through ``F.linear``: one addmm with the bias
fused, autograd's own backward, and the bias never handed back (the caller's ``bias`` is None, so
``out + bias`` is not computed again). Gradients reach megatron's grad buffers as before, through
each parameter's grad-accumulation hook.

Same classes (subclasses), parameters, names and sharding: checkpoints and TP > 1 are unchanged.
With ``mixed_precision.fp8`` both run their products in FP8 instead, at any TP (fp8_linear.py).
"""

from __future__ import annotations

from typing import ClassVar

import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.utils import get_pg_size
from torch import Tensor

from dfm.models.common.fp8_linear import fp8_column_forward, fp8_recipe_of, fp8_row_forward


def runs_alone(linear) -> bool:
    """Nothing of megatron's linear machinery applies: one TP rank, no sequence parallelism, no fused
    weight-gradient accumulation, no expert communication, no deferred or offloaded work. The fixed part
    is decided on the first call and kept on the module (asking the group its size each call cost ~0.5 %
    of the digits-video step); offloading is a context, asked every call."""
    fixed = linear.__dict__.get("_runs_alone")
    if fixed is None:
        fixed = linear._runs_alone = nothing_parallel(linear)
    return fixed and linear.config._cpu_offloading_context is None


def nothing_parallel(linear) -> bool:
    config = linear.config
    return (
        get_pg_size(linear.tp_group) == 1
        and not linear.sequence_parallel
        and not linear.gradient_accumulation_fusion
        and not getattr(linear, "explicit_expert_comm", False)
        and not config.defer_embedding_wgrad_compute
        and linear.weight is not None
    )


class LocalColumnLinear(ColumnParallelLinear):
    """ColumnParallelLinear; input [s, b, in] -> ([s, b, out], None) by ``F.linear`` on one rank."""

    fp8_capable: ClassVar[bool] = True  # under mixed_precision.fp8 (adaLN's rows: no)

    def forward(self, input_: Tensor, weight: Tensor | None = None, runtime_gather_output: bool | None = None):
        recipe = fp8_recipe_of(self) if weight is None and runtime_gather_output is None else None
        if recipe is not None:
            return fp8_column_forward(self, input_, recipe), None
        if weight is None and runs_alone(self):
            return F.linear(input_, self.weight, self.bias), None
        return super().forward(input_, weight, runtime_gather_output)


class LocalRowLinear(RowParallelLinear):
    """RowParallelLinear; input [s, b, in] -> ([s, b, out], None) by ``F.linear`` on one rank."""

    fp8_capable: ClassVar[bool] = True

    def forward(self, input_: Tensor):
        recipe = fp8_recipe_of(self)
        if recipe is not None:
            return fp8_row_forward(self, input_, recipe), None
        if runs_alone(self):
            return F.linear(input_, self.weight, self.bias), None
        return super().forward(input_)
