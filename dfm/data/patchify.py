"""Patchify / unpatchify latents of shape (C, T, H, W); images are T=1.

Tokens are ordered (t, h, w) row-major; each token's features are (pt, ph, pw, c).
"""

from __future__ import annotations

import functools

import torch
from einops import rearrange


def check_patchable(latent_shape: tuple[int, ...], patch_temporal: int, patch_spatial: int) -> None:
    """Raise a ValueError naming the size that a patch does not divide."""
    _, t, h, w = latent_shape
    for name, size, patch in (("T", t, patch_temporal), ("H", h, patch_spatial), ("W", w, patch_spatial)):
        if size % patch != 0:
            raise ValueError(
                f"latent {name}={size} (shape {tuple(latent_shape)}) is not divisible by its patch size {patch}"
            )


def patchify(latent: torch.Tensor, patch_temporal: int, patch_spatial: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[C, T, H, W] -> (tokens [L, pt*ph*pw*C], pos_ids [L, 3] of (t, h, w) patch coordinates)."""
    if latent.dim() == 5 and latent.shape[0] == 1:
        latent = latent[0]
    if latent.dim() != 4:
        raise ValueError(f"expected a latent of shape [C, T, H, W], got {tuple(latent.shape)}")
    check_patchable(tuple(latent.shape), patch_temporal, patch_spatial)
    c, t, h, w = latent.shape
    pt, ps = patch_temporal, patch_spatial
    # c (t pt) (h ph) (w pw) -> (t h w) (pt ph pw c), as plain views: einops' recipe lookup cost ~40 % more
    # per call, and the loaders patchify every sample they read.
    grid = latent.reshape(c, t // pt, pt, h // ps, ps, w // ps, ps).permute(1, 3, 5, 2, 4, 6, 0)
    tokens = grid.reshape((t // pt) * (h // ps) * (w // ps), pt * ps * ps * c)
    return tokens, patch_grid(t // pt, h // ps, w // ps)


def patch_grid(t: int, h: int, w: int) -> torch.Tensor:
    """[t*h*w, 3] long coordinates (t, h, w) in token order (a copy: callers may write to it)."""
    return _patch_grid(t, h, w).clone()


@functools.lru_cache(maxsize=256)
def _patch_grid(t: int, h: int, w: int) -> torch.Tensor:
    # One grid per latent size: the loaders ask for the same few sizes for every sample.
    grid = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack(grid, dim=-1).reshape(-1, 3)


def unpatchify(
    tokens: torch.Tensor, latent_shape: tuple[int, int, int, int], patch_temporal: int, patch_spatial: int
) -> torch.Tensor:
    """tokens [L, pt*ph*pw*C] of one sample -> latent [C, T, H, W]."""
    c, t, h, w = (int(v) for v in latent_shape)
    return rearrange(
        tokens,
        "(t h w) (pt ph pw c) -> c (t pt) (h ph) (w pw)",
        t=t // patch_temporal,
        h=h // patch_spatial,
        w=w // patch_spatial,
        pt=patch_temporal,
        ph=patch_spatial,
        pw=patch_spatial,
        c=c,
    )


def num_tokens(latent_shape: tuple[int, ...], patch_temporal: int, patch_spatial: int) -> int:
    _, t, h, w = latent_shape
    return (t // patch_temporal) * (h // patch_spatial) * (w // patch_spatial)
