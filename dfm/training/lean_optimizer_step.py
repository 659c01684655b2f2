"""megatron's optimizer step for fp32 parameters, without re-collecting its lists every step.

megatron's ``ChainedOptimizer.step`` over one ``FP32Optimizer`` (fp32 training without the distributed
optimizer) walks the parameters in Python twice before torch's fused Adam kernel updates them all:
``get_main_grads_for_grad_norm`` asks each whether it is shared or a tensor-parallel duplicate, and
torch Adam's ``_init_group`` collects the gradient, moment and step lists the kernel takes. Those lists
do not change from step to step: ``LeanStep`` collects them once and reuses them while they are still
the optimizer's (the same groups and state: a loaded checkpoint replaces them, and they are collected
again). The step is megatron's otherwise: ``prepare_grads``, the gradient norm by megatron's function,
its clipping rule, and torch's functional ``adam`` with each group's current hyper-parameters (the
scheduler sets lr and weight decay every step). ~0.35 ms of a 36 ms digits-video step on the CPU (1 %,
alternated A/B, 2026-11-30). Same numbers, bitwise (tests/training/test_lean_optimizer_step.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import megatron.core.optimizer.optimizer as megatron_optimizer
import torch
from torch.optim.adam import adam


@dataclass
class GroupLists:
    """One parameter group's tensors in the order torch's ``_init_group`` collects them."""

    group: dict
    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    steps: list[torch.Tensor]


def optimizer_step(optimizer) -> tuple[bool, float | None, None]:
    """``optimizer.step()`` of a megatron optimizer, through its ``LeanStep`` (made on the first call and
    kept on the optimizer)."""
    lean = optimizer.__dict__.get("_lean_step")
    if lean is None:
        lean = optimizer._lean_step = LeanStep(optimizer)
    return lean()


class LeanStep:
    """``optimizer.step()``'s result, (update made, grad norm, None), for a megatron optimizer ``applies``
    accepts; anything else (or a step before the optimizer has state) goes to ``optimizer.step()``."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.inner = optimizer.chained_optimizers[0] if applies(optimizer) else None
        self.groups: list[GroupLists] | None = None
        self.grads_for_norm: list[torch.Tensor] = []
        self.params: list[torch.Tensor] = []

    def __call__(self) -> tuple[bool, float | None, None]:
        if self.inner is None:
            return self.optimizer.step()
        if self.inner.prepare_grads():  # param.grad = param.main_grad, as megatron's step begins
            return False, None, None
        if not self.lists_current() and not self.collect_lists():
            return self.optimizer.step()
        config = self.inner.config
        grad_norm = megatron_optimizer.get_grad_norm_fp32(
            self.grads_for_norm, grad_stats_parallel_group=self.inner.get_grad_stats_parallel_group()
        )
        if config.clip_grad > 0.0:
            megatron_optimizer.clip_grad_by_total_norm_fp32(self.params, config.clip_grad, grad_norm, False)
        with torch.no_grad():
            for lists in self.groups:
                update(lists)
        return True, grad_norm, None

    def lists_current(self) -> bool:
        """The kept lists are still the optimizer's: its groups, and their first parameters' moment and step
        tensors (a load replaces the groups; ``step_parameters_together`` moves the steps)."""
        torch_opt = self.inner.optimizer
        if self.groups is None or len(self.groups) != len(torch_opt.param_groups):
            return False
        for lists, group in zip(self.groups, torch_opt.param_groups):
            if lists.group is not group or len(group["params"]) != len(lists.params):
                return False
            state = torch_opt.state.get(lists.params[0]) if lists.params else None
            if state is not None and (
                state.get("exp_avg") is not lists.exp_avgs[0] or state.get("step") is not lists.steps[0]
            ):
                return False
        return True

    def collect_lists(self) -> bool:
        """Collect the lists (after ``prepare_grads``) -> False while some parameter has no Adam state yet."""
        torch_opt = self.inner.optimizer
        groups = []
        for group in torch_opt.param_groups:
            params = group["params"]
            states = [torch_opt.state.get(p, {}) for p in params]
            if any("exp_avg" not in s or p.grad is None for p, s in zip(params, states)):
                return False
            groups.append(
                GroupLists(
                    group,
                    list(params),
                    [p.grad for p in params],
                    [s["exp_avg"] for s in states],
                    [s["exp_avg_sq"] for s in states],
                    [s["step"] for s in states],
                )
            )
        self.groups = groups
        self.grads_for_norm = self.inner.get_main_grads_for_grad_norm()
        self.params = self.inner.get_parameters()
        return True


def update(lists: GroupLists) -> None:
    """torch's Adam(W) update of one group, as ``Adam.step`` calls it."""
    group = lists.group
    beta1, beta2 = group["betas"]
    adam(
        lists.params,
        lists.grads,
        lists.exp_avgs,
        lists.exp_avg_sqs,
        [],
        lists.steps,
        amsgrad=False,
        has_complex=False,
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=False,
        foreach=group["foreach"],
        capturable=False,
        differentiable=False,
        fused=group["fused"],
        grad_scale=None,
        found_inf=None,
        decoupled_weight_decay=group["decoupled_weight_decay"],
    )


def applies(optimizer) -> bool:
    """One ``FP32Optimizer`` holding torch's Adam(W) with plain options and no step hooks, and no
    zero counting: what ``LeanStep`` computes exactly as megatron does."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is None or len(chained) != 1 or type(chained[0]) is not megatron_optimizer.FP32Optimizer:
        return False
    inner = chained[0]
    torch_opt = getattr(inner, "optimizer", None)
    if type(torch_opt) not in (torch.optim.Adam, torch.optim.AdamW) or inner.config.log_num_zeros_in_grad:
        return False
    plain = all(
        not (g["amsgrad"] or g["maximize"] or g["capturable"] or g["differentiable"]) for g in torch_opt.param_groups
    )
    hooks = torch_opt._optimizer_step_pre_hooks or torch_opt._optimizer_step_post_hooks or global_step_hooks()
    return plain and not hooks and not getattr(inner, "is_stub_optimizer", False)


def global_step_hooks() -> bool:
    """Hooks registered for every optimizer's step (``torch.optim.optimizer.register_optimizer_step_*_hook``)."""
    from torch.optim import optimizer as torch_optimizer

    return bool(torch_optimizer._global_optimizer_pre_hooks or torch_optimizer._global_optimizer_post_hooks)
