"""How torch's optimizers inside megatron's step their parameters.

Without Transformer Engine or Apex, megatron's Adam is ``torch.optim.Adam(W)``. torch takes its
multi-tensor (``foreach``) path by default for CUDA tensors only; on the CPU it loops over the
parameters in Python, ~16 op calls each. dfm asks for the multi-tensor path on every device: the same
update bitwise (tests/platform/test_optimizer_steps.py), a third less optimizer time on the CPU.
"""

from __future__ import annotations

import torch


def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a megatron optimizer (chained or not; stubs hold none)."""
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return [inner for inner in (getattr(opt, "optimizer", None) for opt in chained) if inner is not None]


def step_parameters_together(optimizer) -> None:
    """Every parameter group of plain tensors steps through torch's multi-tensor path. Groups of other
    tensor types (Megatron-FSDP's DTensors) keep torch's own choice. Call it after building the
    optimizer and after loading a checkpoint (a loaded group brings its saved ``foreach``)."""
    for inner in torch_optimizers(optimizer):
        for group in inner.param_groups:
            if "foreach" in group and all(type(p) in (torch.Tensor, torch.nn.Parameter) for p in group["params"]):
                group["foreach"] = True
