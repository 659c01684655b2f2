"""How torch's optimizers inside megatron's step their parameters.

Without Transformer Engine or Apex, megatron's Adam is ``torch.optim.Adam(W)``, which by default
takes its multi-tensor (``foreach``) path for CUDA tensors and a Python loop per parameter on the
CPU. dfm asks for torch's fused Adam wherever torch has that kernel (the CPU and CUDA among them):
one op for every parameter of a group instead of ~10 multi-tensor ops, 3.5x less optimizer time on
the CPU for the digits-size model. Its update is Adam's formula evaluated element by element; it
equals the per-parameter loop to a few ulps and is bitwise the same for parameters split at multiples
of 16 elements, as megatron's distributed optimizer cuts its shards up to 8-way data parallelism
(tests/platform/test_optimizer_steps.py). Groups whose tensors have no fused kernel take the
multi-tensor path.
"""

from __future__ import annotations

import torch
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices


def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a megatron optimizer (chained or not; stubs hold none)."""
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return [inner for inner in (getattr(opt, "optimizer", None) for opt in chained) if inner is not None]


def _plain(params) -> bool:
    return all(type(p) in (torch.Tensor, torch.nn.Parameter) for p in params)


def _fusable(inner, params) -> bool:
    devices = _get_fused_kernels_supported_devices()
    return isinstance(inner, torch.optim.Adam | torch.optim.AdamW) and all(
        p.device.type in devices and p.is_floating_point() for p in params
    )


def step_parameters_together(optimizer) -> None:
    """Every parameter group of plain tensors steps through torch's fused Adam (its multi-tensor path
    where no fused kernel exists). Groups of other tensor types (Megatron-FSDP's DTensors) keep torch's
    own choice. Call it after building the optimizer and after loading a checkpoint (a loaded group
    brings its saved flags, and its steps where the saved run kept them)."""
    for inner in torch_optimizers(optimizer):
        for group in inner.param_groups:
            params = group["params"]
            if "foreach" not in group or not _plain(params):
                continue
            fused = _fusable(inner, params)
            group["fused"], group["foreach"] = fused, not fused
            if fused:
                _steps_beside_parameters(inner, params)


def _steps_beside_parameters(inner: torch.optim.Optimizer, params) -> None:
    """The fused kernel reads each parameter's ``step`` as an fp32 tensor on the parameter's device;
    the other paths keep it on the host."""
    for param in params:
        step = inner.state.get(param, {}).get("step")
        if isinstance(step, torch.Tensor):
            inner.state[param]["step"] = step.to(device=param.device, dtype=torch.float32)
