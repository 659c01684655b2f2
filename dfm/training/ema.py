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
from megatron.core.utils import to_local_if_dtensor

from dfm.checkpoint.pieces import Owned, without_empty
from dfm.checkpoint.state import with_weights
from dfm.parallel.fsdp_shards import install_main_weights, named_parameters


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
        # Megatron-FSDP: this rank's rows of each parameter, like its main weights.
        self.shadow = [{name: _local(p).float().clone() for name, p in named_parameters(chunk)} for chunk in model]

    @torch.no_grad()
    def update(self, model: list) -> None:
        for shadow, chunk in zip(self.shadow, model):
            for name, param in named_parameters(chunk):
                shadow[name].lerp_(_local(param).float(), 1.0 - self.decay)

    def sharded_state_dict(self, model_states: list[dict[str, Any]]) -> dict[str, Any]:
        """DDP chunks: their sharded state dicts with the EMA tensors in place of the weights."""
        return {
            f"ema{i}": with_weights(state, shadow) for i, (shadow, state) in enumerate(zip(self.shadow, model_states))
        }

    def sharded_pieces(self, owned: list[dict[str, Owned]]) -> dict[str, Any]:
        """Megatron-FSDP chunks: this rank's rows of the EMA (rows like the main weights' ``owned``)."""
        return {
            f"ema{i}": without_empty(
                {name: part.piece.sharded(f"ema.{part.key}", shadow[name].view(-1)) for name, part in parts.items()}
            )
            for i, (shadow, parts) in enumerate(zip(self.shadow, owned))
        }

    @torch.no_grad()
    def load(self, loaded: dict[str, Any], owned: list[dict[str, Owned]] | None = None) -> None:
        """From ``sharded_state_dict`` (DDP) or ``sharded_pieces(owned)`` (Megatron-FSDP) as loaded."""
        for index, shadow in enumerate(self.shadow):
            for name, tensor in loaded[f"ema{index}"].items():
                if owned is None:
                    shadow[name].copy_(tensor)
                else:
                    owned[index][name].piece.fill(shadow[name].view(-1), tensor)

    @contextlib.contextmanager
    def swapped_in(self, model: list) -> Iterator[None]:
        """Run the model with the EMA weights inside the block; the trained weights come back after."""
        saved = [{n: _local(p).clone() for n, p in named_parameters(chunk)} for chunk in model]
        copy_into(model, self.shadow)
        try:
            yield
        finally:
            copy_into(model, saved)


@torch.no_grad()
def copy_into(model: list, weights: list[dict[str, torch.Tensor]]) -> None:
    for chunk, chunk_weights in zip(model, weights):
        for name, param in named_parameters(chunk):
            _local(param).copy_(chunk_weights[name])
    install_main_weights(model)


def _local(param) -> torch.Tensor:
    """The tensor this rank holds: under Megatron-FSDP its rows of the main weights (ema is sharded alike)."""
    return to_local_if_dtensor(param).detach()


def build_ema(model: list, decay) -> WeightEMA | None:
    return WeightEMA(model, decay) if decay is not None else None
