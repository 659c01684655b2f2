"""Checks that a cooked sample fits the model before it trains, naming its shard, key and the mismatch."""

from __future__ import annotations

import torch

from dfm.data.energon.cooker import BadSampleError, CookedDiffusionSample, source_description
from dfm.data.prepare.shards import POOLED_PART


def count_non_finite(tensor: torch.Tensor) -> int:
    if bool(torch.isfinite(tensor.sum())):  # one reduction for the usual all-finite sample
        return 0
    return int((~torch.isfinite(tensor)).sum())  # 0 too when only the sum overflowed


def check_pooled_text(sample: CookedDiffusionSample, pooled_text_dim: int, where: str) -> None:
    """A model with a pooled text input (FLUX) needs every sample's '.pooled.pth' of that width."""
    pooled = sample.pooled_text
    if pooled is None:
        raise BadSampleError(
            where,
            f"no pooled text vector '.{POOLED_PART}' (model.pooled_text_dim={pooled_text_dim}: FLUX conditions "
            "on CLIP's pooled caption embedding); prepare the shards with --encoders flux",
        )
    if pooled.shape[0] != pooled_text_dim:
        raise BadSampleError(
            where,
            f"pooled text '.{POOLED_PART}' of shape {tuple(pooled.shape)} is {pooled.shape[0]} wide, "
            f"expected model.pooled_text_dim={pooled_text_dim}",
        )


def check_cooked_sample(
    sample: CookedDiffusionSample,
    in_channels: int | None,
    text_embed_dim: int | None,
    pooled_text_dim: int | None = None,
) -> None:
    """Raise BadSampleError for a latent of the wrong channel count, text of the wrong width, a
    missing or wrong pooled text vector (only checked with ``pooled_text_dim``) or non-finite values
    (``None`` skips the size check)."""
    where = source_description(sample.__key__, sample.__sources__)
    latent, text = sample.latent, sample.text_embeddings
    if in_channels is not None and latent.shape[0] != in_channels:
        raise BadSampleError(
            where,
            f"latent '.pth' of shape {tuple(latent.shape)} has {latent.shape[0]} channels, "
            f"expected model.in_channels={in_channels}",
        )
    if text_embed_dim is not None and text.shape[1] != text_embed_dim:
        raise BadSampleError(
            where,
            f"text embeddings '.pickle' of shape {tuple(text.shape)} are {text.shape[1]} wide, "
            f"expected model.text_embed_dim={text_embed_dim}",
        )
    parts = [("latent '.pth'", latent), ("text embeddings '.pickle'", text)]
    if pooled_text_dim is not None:
        check_pooled_text(sample, pooled_text_dim, where)
        parts.append((f"pooled text '.{POOLED_PART}'", sample.pooled_text))
    for what, tensor in parts:
        bad = count_non_finite(tensor)
        if bad:
            raise BadSampleError(where, f"{what} holds {bad} non-finite values (NaN or inf) of {tensor.numel()}")
