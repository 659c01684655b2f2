"""Cooker: energon crude webdataset samples (``.pth`` / ``.pickle`` / ``.json``) -> CookedDiffusionSample.

Accepts our shards and NVIDIA DFM's: a latent [C, T, H, W] or [1, C, T, H, W], text embeddings
[L, D] or [1, L, D] as a tensor or numpy array, metadata as a dict (or undecoded JSON bytes).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
from megatron.energon import Cooker, Sample, basic_sample_keys, edataclass, stateless

LATENT_PART = "pth"
TEXT_PART = "pickle"
METADATA_PART = "json"


@edataclass
class CookedDiffusionSample(Sample):
    latent: torch.Tensor  # [C, T, H, W]
    text_embeddings: torch.Tensor  # [L, D], unpadded
    metadata: dict


def describe_source(crude: dict) -> str:
    """'shard <name>, key <key>' for error messages."""
    sources = crude.get("__sources__") or ()
    shard = sources[0].shard_name if sources else "<unknown shard>"
    return f"shard {shard}, key {crude.get('__key__', '<unknown key>')}"


def crude_part(crude: dict, part: str) -> Any:
    # energon names parts by extension; tolerate a leading dot as some writers produce.
    for name in (part, f".{part}"):
        if name in crude:
            return crude[name]
    present = sorted(k for k in crude if not k.startswith("__"))
    raise KeyError(f"{describe_source(crude)}: missing part '.{part}' (parts present: {present})")


def as_tensor(value: Any, what: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    raise TypeError(f"{what} is a {type(value).__name__}, expected a torch tensor or numpy array")


def drop_leading_unit_dim(tensor: torch.Tensor, want_dims: int, what: str) -> torch.Tensor:
    if tensor.dim() == want_dims + 1 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.dim() != want_dims:
        raise ValueError(f"{what} has shape {tuple(tensor.shape)}, expected {want_dims} dims (or a leading 1)")
    return tensor


def decode_metadata(value: Any, where: str) -> dict:
    if isinstance(value, (bytes, bytearray, str)):
        value = json.loads(value)
    if not isinstance(value, dict):
        raise TypeError(f"{where}: '.json' holds a {type(value).__name__}, expected an object")
    return value


@stateless
def cook_diffusion_sample(crude: dict) -> CookedDiffusionSample:
    """One crude sample -> CookedDiffusionSample; a missing or malformed part raises naming shard and key."""
    where = describe_source(crude)
    latent = as_tensor(crude_part(crude, LATENT_PART), f"{where}: latent '.{LATENT_PART}'")
    text = as_tensor(crude_part(crude, TEXT_PART), f"{where}: text embeddings '.{TEXT_PART}'")
    return CookedDiffusionSample(
        **basic_sample_keys(crude),
        latent=drop_leading_unit_dim(latent, 4, f"{where}: latent '.{LATENT_PART}'").float(),
        text_embeddings=drop_leading_unit_dim(text, 2, f"{where}: text embeddings '.{TEXT_PART}'").float(),
        metadata=decode_metadata(crude_part(crude, METADATA_PART), where),
    )


def diffusion_cookers() -> tuple[Cooker, ...]:
    """The cookers a TaskEncoder registers to read prepared diffusion shards."""
    return (Cooker(cook_diffusion_sample),)
