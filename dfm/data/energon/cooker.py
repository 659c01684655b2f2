"""Cooker: energon crude webdataset samples (``.pth`` / ``.pickle`` / ``.json``, and FLUX's optional
``.pooled.pth``) -> CookedDiffusionSample.

Accepts our shards and NVIDIA DFM's: a latent [C, T, H, W] or [1, C, T, H, W], text embeddings
[L, D] or [1, L, D] as a tensor or numpy array, metadata as a dict (or undecoded JSON bytes).
A sample that cannot train raises ``BadSampleError`` naming its shard path, key and what is wrong.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from megatron.energon import Cooker, Sample, basic_sample_keys, edataclass, stateless

from dfm.data.prepare.shards import BYT5_PART, FIRST_FRAME_PART, IMAGE_CONDITION_PART, IMAGE_PART, POOLED_PART

LATENT_PART = "pth"
TEXT_PART = "pickle"
METADATA_PART = "json"


class BadSampleError(ValueError):
    """A sample that cannot train; ``where`` is 'shard <path>, key <key>'."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where}: {problem}")
        self.where = where


@edataclass
class CookedDiffusionSample(Sample):
    latent: torch.Tensor  # [C, T, H, W]
    text_embeddings: torch.Tensor  # [L, D], unpadded
    metadata: dict
    pooled_text: torch.Tensor | None = None  # [D_pool] CLIP's pooled text vector (FLUX); None: no such part
    # HunyuanVideo 1.5 (None: no such part): ByT5 text [L2, D2], first-frame latent [C, 1, H, W], SigLIP [L_img, D_img]
    text_2: torch.Tensor | None = None
    first_frame: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None
    # Wan 2.2 I2V-A14B: the image-condition latent [C, T, H, W] (None: no such part)
    image_condition: torch.Tensor | None = None


def sample_location(shard: Any, key: Any) -> str:
    """'shard <dataset>/<shard>.tar, key <key>' for error messages."""
    return f"shard {shard}, key {key if key is not None else '<unknown key>'}"


def source_description(key: Any, sources: Sequence[Any] | None) -> str:
    shard = f"{sources[0].dataset_path}/{sources[0].shard_name}" if sources else "<unknown shard>"
    return sample_location(shard, key)


def describe_source(crude: dict) -> str:
    return source_description(crude.get("__key__"), crude.get("__sources__"))


def crude_part(crude: dict, part: str) -> Any:
    # energon names parts by extension; tolerate a leading dot as some writers produce.
    for name in (part, f".{part}"):
        if name in crude:
            return crude[name]
    present = sorted(k for k in crude if not k.startswith("__"))
    raise BadSampleError(describe_source(crude), f"missing part '.{part}' (parts present: {present})")


def as_tensor(value: Any, where: str, what: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    raise BadSampleError(where, f"{what} is a {type(value).__name__}, expected a torch tensor or numpy array")


def drop_leading_unit_dim(tensor: torch.Tensor, want_dims: int, where: str, what: str) -> torch.Tensor:
    if tensor.dim() == want_dims + 1 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.dim() != want_dims:
        raise BadSampleError(
            where, f"{what} has shape {tuple(tensor.shape)}, expected {want_dims} dims (or a leading 1)"
        )
    return tensor


def decode_metadata(value: Any, where: str) -> dict:
    if isinstance(value, (bytes, bytearray, str)):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise BadSampleError(where, f"'.json' is not valid JSON ({error})") from error
    if not isinstance(value, dict):
        raise BadSampleError(where, f"'.json' holds a {type(value).__name__}, expected an object")
    return value


def read_tensor(crude: dict, part: str, dims: int, what: str) -> torch.Tensor:
    where = describe_source(crude)
    tensor = as_tensor(crude_part(crude, part), where, f"{what} '.{part}'")
    return drop_leading_unit_dim(tensor, dims, where, f"{what} '.{part}'").float()


def read_optional_tensor(crude: dict, part: str, dims: int, what: str) -> torch.Tensor | None:
    """The part as ``read_tensor`` reads it, or None when the sample has no such part."""
    if part not in crude and f".{part}" not in crude:
        return None
    return read_tensor(crude, part, dims, what)


@stateless
def cook_diffusion_sample(crude: dict) -> CookedDiffusionSample:
    """One crude sample -> CookedDiffusionSample; a missing or malformed part raises naming shard and key."""
    return CookedDiffusionSample(
        **basic_sample_keys(crude),
        latent=read_tensor(crude, LATENT_PART, 4, "latent"),
        text_embeddings=read_tensor(crude, TEXT_PART, 2, "text embeddings"),
        metadata=decode_metadata(crude_part(crude, METADATA_PART), describe_source(crude)),
        pooled_text=read_optional_tensor(crude, POOLED_PART, 1, "pooled text"),
        text_2=read_optional_tensor(crude, BYT5_PART, 2, "ByT5 text embeddings"),
        first_frame=read_optional_tensor(crude, FIRST_FRAME_PART, 4, "first-frame latent"),
        image_embeds=read_optional_tensor(crude, IMAGE_PART, 2, "image embeddings"),
        image_condition=read_optional_tensor(crude, IMAGE_CONDITION_PART, 4, "image-condition latent"),
    )


def diffusion_cookers() -> tuple[Cooker, ...]:
    """The cookers a TaskEncoder registers to read prepared diffusion shards."""
    return (Cooker(cook_diffusion_sample),)
