"""torch's optimizers import dynamo only to keep it out of their methods: ~1 s of CPU per process.

``Optimizer.add_param_group``, ``zero_grad``, ``state_dict`` and ``load_state_dict`` are wrapped by
``torch._disable_dynamo`` and each optimizer's ``step`` by ``_use_grad_for_differentiable``; both
import ``torch._dynamo`` on their first call, so building megatron's optimizer imports dynamo in every
training rank although nothing is compiled. Dynamo can only trace once it is imported: until then
these wrappers call the undecorated method (the step under the optimizer's grad mode, as
``_use_grad`` sets it; its graph breaks do nothing outside a trace). Once anything has imported
dynamo (``torch.compile``), the decorated method runs as before.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

from dfm.platform.compat.patch import TargetChanged


def _dynamo_imported() -> bool:
    return "torch._dynamo" in sys.modules


def undecorated_until_dynamo(decorated: Callable[..., Any]) -> Callable[..., Any]:
    """A ``torch._disable_dynamo`` method -> one calling the method itself while dynamo is not imported."""
    method = getattr(decorated, "__wrapped__", None)
    if method is None or decorated.__code__.co_name != "inner":
        raise TargetChanged(f"{decorated!r} is no longer wrapped by torch._disable_dynamo")

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        return decorated(*args, **kwargs) if _dynamo_imported() else method(*args, **kwargs)

    return call


def step_until_dynamo(decorated: Callable[..., Any]) -> Callable[..., Any]:
    """An optimizer's ``_use_grad_for_differentiable`` step -> one that sets the grad mode itself while
    dynamo is not imported. Where torch already wrapped the step with its step hooks (an optimizer of
    the class was built before), the replacement is wrapped with them again."""
    hooked = getattr(decorated, "hooked", False)
    use_grad = decorated.__wrapped__ if hooked else decorated
    if getattr(use_grad, "until_dynamo", False):  # already this replacement (torch hooked it on a class)
        return decorated
    if use_grad.__code__.co_name != "_use_grad" or not {"set_grad_enabled", "graph_break"} <= set(
        use_grad.__code__.co_names
    ):
        raise TargetChanged("the step is no longer torch's _use_grad, setting the grad mode around graph breaks")
    step = use_grad.__wrapped__

    @functools.wraps(step)
    def call(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if _dynamo_imported():
            return use_grad(self, *args, **kwargs)
        with torch.set_grad_enabled(self.defaults["differentiable"]):
            return step(self, *args, **kwargs)

    call.until_dynamo = True
    if hooked:
        call = torch.optim.Optimizer.profile_hook_step(call)
        call.hooked = True
    return call
