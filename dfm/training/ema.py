"""Exponential moving average of the model weights (``optimizer.ema_decay``), kept in fp32.

Each rank averages the parameters it holds (its TP / PP / EP shard), so EMA needs no
communication and is sharded exactly like the model: it is checkpointed under the model's
global tensor names (``ema<chunk>`` next to ``model<chunk>``) and reshards the same way.
Generation (validation samples, the inference script) uses the EMA weights when a run has them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from dfm.checkpoint.state import with_weights


class WeightEMA:
    """``ema = decay * ema + (1 - decay) * param`` after every applied optimizer step."""

    def __init__(self, model: list, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"optimizer.ema_decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.shadow: list[dict[str, torch.Tensor]] = []
        self.reset(model)

    def reset(self, model: list) -> None:
        """Start the average at the model's current weights."""
        self.shadow = [
            {name: p.detach().float().clone() for name, p in chunk.module.named_parameters()} for chunk in model
        ]

    @torch.no_grad()
    def update(self, model: list) -> None:
        for shadow, chunk in zip(self.shadow, model):
            for name, param in chunk.module.named_parameters():
                shadow[name].lerp_(param.detach().float(), 1.0 - self.decay)

    def sharded_state_dict(self, model_states: list[dict[str, Any]]) -> dict[str, Any]:
        """The model chunks' sharded state dicts with the EMA tensors in place of the weights."""
        return {
            f"ema{i}": with_weights(state, shadow) for i, (shadow, state) in enumerate(zip(self.shadow, model_states))
        }

    def load(self, loaded: dict[str, Any]) -> None:
        for index, shadow in enumerate(self.shadow):
            for name, tensor in loaded[f"ema{index}"].items():
                shadow[name].copy_(tensor)

    @contextlib.contextmanager
    def swapped_in(self, model: list) -> Iterator[None]:
        """Run the model with the EMA weights inside the block; the trained weights come back after."""
        saved = [{n: p.detach().clone() for n, p in chunk.module.named_parameters()} for chunk in model]
        copy_into(model, self.shadow)
        try:
            yield
        finally:
            copy_into(model, saved)


@torch.no_grad()
def copy_into(model: list, weights: list[dict[str, torch.Tensor]]) -> None:
    for chunk, chunk_weights in zip(model, weights):
        for name, param in chunk.module.named_parameters():
            param.copy_(chunk_weights[name])


def build_ema(model: list, decay) -> WeightEMA | None:
    return WeightEMA(model, decay) if decay is not None else None
