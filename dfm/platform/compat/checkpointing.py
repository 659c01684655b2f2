"""megatron's distributed-optimizer checkpoints with torch's Adam (no Apex / Transformer Engine, any device).

Megatron's checkpointing assumes the fused Adam of Apex/TE, which keeps ``step`` in the param groups.
torch's Adam keeps ``step`` per parameter, and three places trip over it: one megatron method (wrapped
at install time) and two states of the optimizer around a load (fixed by ``load_checkpoint``).
dfm's own checkpoint format reads and writes each parameter's main weight and moments through
megatron's private per-parameter accessors, under public names the registry adds (``calling``).
"""

from __future__ import annotations

import functools

import torch

from dfm.platform.compat.patch import MISSING, TargetChanged
from dfm.platform.optimizer_steps import torch_optimizers


def copying_given_keys_only(original):
    """Wraps ``DistributedOptimizer._set_main_param_and_optimizer_states``, which copies every key of
    the parameter's optimizer state from ``tensors``, while the fully-reshardable loader leaves out
    ``step`` (restored separately): a key not given keeps its current value."""

    @functools.wraps(original)
    def set_states(self, model_param, tensors):
        if not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            tensors = {**self.optimizer.state[main_param], **tensors}
        return original(self, model_param, tensors)

    return set_states


def ensure_adam_state(optimizer) -> None:
    """Give every parameter an Adam state (zeros, step 0) before a checkpoint is loaded into it.

    ``DistributedOptimizer.state_dict`` reads ``state["step"]`` of every parameter, and its
    ``init_state_fn`` for torch's Adam creates none: a never-stepped optimizer could not be loaded.
    """
    for inner in torch_optimizers(optimizer):
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if "step" not in state:
                    state["step"] = torch.tensor(0.0)
                    state.setdefault("exp_avg", torch.zeros_like(param.data))
                    state.setdefault("exp_avg_sq", torch.zeros_like(param.data))


def unshare_adam_steps(optimizer) -> None:
    """After ``DistributedOptimizer.load_state_dict`` every parameter's ``step`` is one shared
    tensor; torch's Adam increments steps in place, so it would advance once per parameter."""
    for inner in torch_optimizers(optimizer):
        for state in getattr(inner, "state", {}).values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def calling(private: str):
    """Builds a patch that adds a public method calling megatron's private method ``private``, so
    dfm's use of it goes through the registry (whose source check guards the private method)."""

    def build(original):
        if original is not MISSING:
            raise TargetChanged(f"the class already has the attribute this patch adds ({original!r})")

        def method(self, *args):
            return getattr(self, private)(*args)

        method.__doc__ = f"megatron's ``{private}`` (added by dfm's compat registry)."
        return method

    return build
