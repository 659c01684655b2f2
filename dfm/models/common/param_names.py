"""Global parameter names: a parameter's name in the whole model, whatever the parallel layout.

A pipeline stage numbers its blocks from 0 (``layers.{local}.``) and an expert-parallel rank its
experts from 0 (``local_experts.{local}.``); the global name numbers both over the whole model.
Initialisation seeds each parameter by its global name, checkpoints and full-weight files key
tensors by it, so every layout starts from, saves and compares the same weights.
"""

from __future__ import annotations

from megatron.core import parallel_state

LAYERS = "layers."
EXPERTS = ".local_experts."


def global_layer_prefix(layer_offset: int, local_index: int) -> str:
    """``layers.{global index}.`` of this stage's block ``local_index`` (stage starts at ``layer_offset``)."""
    return f"{LAYERS}{layer_offset + local_index}."


def global_expert_index(local_index: int, num_experts: int) -> int:
    """This expert-parallel rank's expert ``local_index`` -> its index over all ``num_experts``."""
    num_local = num_experts // parallel_state.get_expert_model_parallel_world_size()
    return parallel_state.get_expert_model_parallel_rank() * num_local + local_index


def global_param_name(name: str, layer_offset: int, num_experts: int | None = None) -> str:
    """A stage-local parameter name -> its global name (layers and experts renumbered)."""
    if not name.startswith(LAYERS):
        return name
    index, rest = name[len(LAYERS) :].split(".", 1)
    if EXPERTS in rest:
        head, tail = rest.split(EXPERTS, 1)
        expert, tail = tail.split(".", 1)
        rest = f"{head}{EXPERTS}{global_expert_index(int(expert), num_experts)}.{tail}"
    return global_layer_prefix(layer_offset, int(index)) + rest
