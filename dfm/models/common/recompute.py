"""Full activation recomputation over runs of layers, as megatron-core's TransformerBlock defines it.

* uniform: the layers of a stage are split into runs of ``recompute_num_layers``; only each
  run's input is kept, the run is recomputed in the backward pass.
* block: the first ``recompute_num_layers`` layers of a stage are recomputed one by one, the
  rest keep their activations (use spare memory, save recompute time).

Selective recomputation (``recompute_granularity=selective``, the core attention only) needs no
code here: megatron's Attention checkpoints its core attention itself under that setting.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


def layer_runs(num_layers: int, config, training: bool) -> list[tuple[int, int, bool]]:
    """(start, stop, recompute) runs covering ``num_layers`` local layers in order."""
    if config.recompute_granularity != "full" or not training:
        return [(0, num_layers, False)]
    per_run = config.recompute_num_layers
    if config.recompute_method == "uniform":
        return [(start, min(start + per_run, num_layers), True) for start in range(0, num_layers, per_run)]
    if config.recompute_method == "block":
        return [(index, index + 1, index < per_run) for index in range(num_layers)]
    raise ValueError(f"recompute_method={config.recompute_method!r}; valid: uniform, block")


def forward_layers(layers: nn.ModuleList, runs: list[tuple[int, int, bool]], hidden: Tensor, inputs) -> Tensor:
    """hidden [s, b, h] through ``layers`` (each called as layer(hidden, inputs)), run by run.
    Non-reentrant torch checkpointing: it takes any Python object as an argument (``inputs``, a
    dataclass of tensors), the grads of every tensor in it (cond, context) flow, and the CPU/CUDA
    RNG state is replayed for the recomputation. The reentrant form (megatron's
    ``tensor_parallel.checkpoint``) would need the tensors as positional args instead."""
    for start, stop, recompute in runs:
        if recompute:
            hidden = checkpoint(_run_range, layers, start, stop, hidden, inputs, use_reentrant=False)
        else:
            hidden = _run_range(layers, start, stop, hidden, inputs)
    return hidden


def _run_range(layers: nn.ModuleList, start: int, stop: int, hidden: Tensor, inputs) -> Tensor:
    for layer in layers[start:stop]:
        hidden = layer(hidden, inputs)
    return hidden
