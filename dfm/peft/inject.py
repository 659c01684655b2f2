"""Put LoRA adapters on a built model chunk, and freeze its base weights.

Called once per chunk after the model is built (materialised or on meta) and before DDP / FSDP
wraps it, so only the adapters reach gradient buffers and the optimizer. A is drawn like every dfm
weight, from (seed, its global name), so every layout starts from the same adapters; B is zero.
"""

from __future__ import annotations

import torch
from torch import nn

from dfm.config.peft import ADAPTER, PeftConfig, is_adapter_param
from dfm.models.common.init import init_params, mark_tensor_parallel_weights
from dfm.peft.adapter import LoraAdapter, add_output, linear_kind
from dfm.peft.errors import PeftError
from dfm.peft.sharded import shard_adapters_in_checkpoints
from dfm.peft.targets import lora_targets


def global_module_name(model: nn.Module, name: str) -> str:
    """A module's global name (its blocks renumbered as its parameters are)."""
    return model.global_param_name(f"{name}.x")[:-2] if name.count(".") else name


def _linears(model: nn.Module) -> dict[str, nn.Module]:
    """{global module name: module} of every linear dfm can put an adapter on."""
    return {global_module_name(model, name): module for name, module in model.named_modules() if _kind(module)}


def _kind(module: nn.Module) -> str | None:
    try:
        return linear_kind(module)
    except PeftError:
        return None


def add_lora(model: nn.Module, peft: PeftConfig, model_cfg, rules, seed: int, std: float = 0.02) -> list[str]:
    """Adapters on ``model``'s targeted linears (this stage's), base frozen when ``peft.freeze_base``;
    adapters are initialised unless the model is on meta (FSDP initialises its shards itself).
    ``rules``: the family's conversion rules (``dfm.convert.lora.family_rules``). A model of several
    submodels (Wan 2.2's both experts: ``submodels()``) gets each one's adapters, named behind its
    prefix. Returns the global names of the linears given adapters."""
    if peft.lora_dropout and _tp() > 1:
        # A column-parallel adapter's input is whole on every TP rank: per-rank masks would differ.
        raise PeftError("peft.lora_dropout > 0 runs without tensor parallelism only (TP size 1)")
    mark_tensor_parallel_weights(model)  # the adapters copy their base weight's TP split
    # Each expert's linears are named as a one-expert model's (its rules' names) behind its prefix.
    parts = model.submodels() if hasattr(model, "submodels") else {"": model}
    done = []
    for expert, part in parts.items():
        prefix = f"{expert}." if expert else ""
        done += [f"{prefix}{name}" for name in _add_adapters(part, prefix, peft, (model_cfg, rules), seed, std)]
    if peft.freeze_base:
        for param_name, param in model.named_parameters():
            param.requires_grad_(is_adapter_param(param_name))
    return done


def _add_adapters(model: nn.Module, prefix: str, peft: PeftConfig, family: tuple, seed: int, std: float) -> list[str]:
    """``add_lora`` on one model (``family``: its ModelConfig and rules); ``prefix``: its parameters'
    prefix in the whole model, which the adapters' init draws by. -> the linears' global names."""
    model_cfg, rules = family
    linears = _linears(model)
    targets = lora_targets(model_cfg, peft.target_modules, list(linears), rules)
    by_global = {global_module_name(model, name): module for name, module in model.named_modules()}
    done = []
    for name, target in targets.items():
        module = by_global.get(name)
        if module is None:  # on another pipeline stage
            continue
        kind = linear_kind(module)
        if kind is None:
            raise PeftError(
                f"peft.target_modules: {target.parts} is {name} in dfm, a {type(module).__name__}, not a linear"
            )
        out_features = module.weight.shape[0] * (_tp() if kind == "column" else 1)
        adapter = LoraAdapter(
            module,
            kind,
            target.part_rows(out_features),
            target.targeted,
            peft.lora_rank,
            peft.scaling,
            peft.lora_dropout,
        )
        module.add_module(ADAPTER, adapter)
        module.register_forward_hook(add_output)
        if kind != "plain":
            shard_adapters_in_checkpoints(module)
        if module.weight.device.type != "meta":
            init_params(adapter, seed, lambda local, at=f"{prefix}{name}": f"{at}.{ADAPTER}.{local}", std)
        done.append(name)
    return done


def _tp() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """{global name: this rank's tensor} of the adapters of one unwrapped chunk."""
    return {model.global_param_name(n): p for n, p in model.named_parameters() if is_adapter_param(n)}
