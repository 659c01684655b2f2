"""Fixes for megatron-core 0.16.1 without Apex / Transformer Engine (on any device).

Megatron's DistributedOptimizer checkpointing assumes the fused Adam of Apex/TE, which keeps
``step`` in the param groups. With torch's Adam (our CPU path, and GPUs without TE) ``step`` is
a per-parameter state, and two call sites trip over it. Both fixes are narrow and named.
"""

from __future__ import annotations

import functools

import torch

WRITTEN_FOR = "0.16.1"


def ensure_adam_state(optimizer) -> None:
    """Give every parameter an Adam state (zeros, step 0) before a checkpoint is loaded into it.

    ``DistributedOptimizer.state_dict`` reads ``state["step"]`` of every parameter, and its
    ``init_state_fn`` for torch's Adam creates none: a never-stepped optimizer could not be loaded.
    """
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    for inner in (getattr(opt, "optimizer", None) for opt in chained):
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if "step" not in state:
                    state["step"] = torch.tensor(0.0)
                    state.setdefault("exp_avg", torch.zeros_like(param.data))
                    state.setdefault("exp_avg_sq", torch.zeros_like(param.data))


def patch_distrib_optimizer_step_copy() -> None:
    """``DistributedOptimizer._set_main_param_and_optimizer_states`` copies every state key, but the
    fully-reshardable loader skips ``step`` (restored separately): copy only the keys given."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(original, "_dfm_patched", False):
        return

    @functools.wraps(original)
    def set_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        destinations = {"param": main_param, **self.optimizer.state[main_param]}
        for key, value in tensors.items():
            destinations[key].copy_(value)

    set_states._dfm_patched = True
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def unshare_adam_steps(optimizer) -> None:
    """After ``DistributedOptimizer.load_state_dict`` every parameter's ``step`` is one shared
    tensor; torch's Adam increments steps in place, so it would advance once per parameter."""
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    for inner in (getattr(opt, "optimizer", None) for opt in chained):
        for state in getattr(inner, "state", {}).values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
