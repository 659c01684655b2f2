"""Adapters of a dfm checkpoint -> a diffusers LoRA file, or merged into the base weights.

The file holds, per targeted diffusers module, ``transformer.<module>.lora_A.weight`` [r, in] and
``lora_B.weight`` [out, r] (the keys ``pipeline.load_lora_weights`` reads for Wan and FLUX) and
the peft config (rank, alpha, targets) in the safetensors metadata diffusers reads with it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from dfm.config.peft import ADAPTER, PeftConfig, is_adapter_param
from dfm.peft.errors import PeftError
from dfm.peft.targets import LoraTarget, lora_targets

PREFIX = "transformer"  # the pipeline component the LoRA belongs to
FILE_NAME = "pytorch_lora_weights.safetensors"  # diffusers' default name, found in a folder
METADATA_KEY = "lora_adapter_metadata"  # diffusers.loaders.lora_base.LORA_ADAPTER_METADATA_KEY


def _pairs(weights: dict[str, Tensor], model_cfg, peft: PeftConfig, rules):
    """(target, part index, A [r, in], B [n_s, r]) of every adapter in ``weights`` (global names, full
    tensors); ``rules``: the family's conversion rules."""
    if not any(is_adapter_param(name) for name in weights):
        raise PeftError("the checkpoint holds no LoRA adapters (was it trained with peft.lora_rank > 0?)")
    for target in lora_targets(model_cfg, peft.target_modules, [], rules).values():
        for index, hit in enumerate(target.targeted):
            if hit:
                a, b = (f"{target.module}.{ADAPTER}.{m}.{index}" for m in "AB")
                if a not in weights or b not in weights:
                    raise PeftError(f"the checkpoint has no adapter {a} / {b} that peft.target_modules asks for")
                yield target, index, weights[a], weights[b]


def lora_state_dict(weights: dict[str, Tensor], model_cfg, peft: PeftConfig, rules) -> dict[str, Tensor]:
    """{diffusers LoRA key: tensor} of the adapters in ``weights``."""
    out = {}
    for target, index, a, b in _pairs(weights, model_cfg, peft, rules):
        module = f"{PREFIX}.{target.parts[index]}"
        out[f"{module}.lora_A.weight"], out[f"{module}.lora_B.weight"] = a.contiguous(), b.contiguous()
    return out


def lora_metadata(state: dict[str, Tensor], peft: PeftConfig) -> dict[str, str]:
    """The safetensors metadata diffusers turns into the peft LoraConfig."""
    modules = sorted({key.removeprefix(f"{PREFIX}.").rsplit(".lora_", 1)[0] for key in state})
    config = {"r": peft.lora_rank, "lora_alpha": peft.lora_alpha or peft.lora_rank, "target_modules": modules}
    config = {f"{PREFIX}.{key}": value for key, value in config.items()}  # per pipeline component
    return {"format": "pt", METADATA_KEY: json.dumps(config, sort_keys=True)}


def write_lora_file(state: dict[str, Tensor], peft: PeftConfig, path: str | Path, dtype) -> Path:
    """The diffusers LoRA file of ``state`` (``lora_state_dict``), at ``path`` (a .safetensors file)."""
    from safetensors.torch import save_file

    state = {key: tensor.to(dtype) for key, tensor in state.items()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path), metadata=lora_metadata(state, peft))
    return path


def _delta(target: LoraTarget, pairs, out_features: int, in_features: int, scaling: float) -> Tensor:
    """scaling * B A of every part, placed at the part's rows of the dfm weight: [out, in] fp32."""
    delta = torch.zeros(out_features, in_features)
    rows = target.part_rows(out_features)
    for index, a, b in pairs:
        delta[rows[index]] += scaling * (b.float() @ a.float())
    return delta


def merged_weights(weights: dict[str, Tensor], model_cfg, peft: PeftConfig, rules) -> dict[str, Tensor]:
    """The base weights of ``weights`` with every adapter's scaling B A added (adapters dropped)."""
    by_module: dict[str, tuple[LoraTarget, list]] = {}
    for target, index, a, b in _pairs(weights, model_cfg, peft, rules):
        by_module.setdefault(target.module, (target, []))[1].append((index, a, b))
    merged = {name: tensor for name, tensor in weights.items() if not is_adapter_param(name)}
    for module, (target, pairs) in by_module.items():
        base = merged[f"{module}.weight"]
        delta = _delta(target, pairs, base.shape[0], base.shape[1], peft.scaling)
        merged[f"{module}.weight"] = (base.float() + delta).to(base.dtype)
    return merged
