"""Per-sample quantities on packed sequences.

A pack concatenates the tokens of N samples along S; ``sample_ids [S]`` says which sample each
token belongs to. Pipelines keep one noise level per sample ``[N]`` and need it per token, and
report one loss per sample, averaged over that sample's real tokens only, so that a 1-token
image and a 100-token video with the same per-token error weigh the same.
"""

from __future__ import annotations

import torch


def per_token(values: torch.Tensor, sample_ids: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Broadcast per-sample ``values [N]`` to the tokens of ``like [S, *]``: returns ``[S, 1, ...]``."""
    token_values = values.to(like.device)[sample_ids.to(like.device)]
    return token_values.reshape(-1, *([1] * (like.dim() - 1)))


def masked_mean_per_sample(
    per_token_values: torch.Tensor,
    sample_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    num_samples: int,
) -> torch.Tensor:
    """Mean of ``per_token_values [S, *]`` over each sample's real tokens and feature dims -> ``[N]``.

    Padding tokens (``loss_mask == 0``) contribute nothing, whatever their values (NaN included).
    A sample without real tokens gets 0 rather than NaN.
    """
    features_per_token = per_token_values[0].numel() if per_token_values.dim() > 1 else 1
    token_sums = per_token_values.reshape(per_token_values.shape[0], -1).sum(dim=1)
    sums, real_tokens = masked_sums_per_sample(token_sums, sample_ids, loss_mask, num_samples)
    denominators = real_tokens * features_per_token
    return sums / torch.where(denominators > 0, denominators, torch.ones_like(denominators))


def masked_sums_per_sample(
    values: torch.Tensor, sample_ids: torch.Tensor, loss_mask: torch.Tensor, num_samples: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``values [S, *]`` weighted by ``loss_mask [S]`` and summed per sample -> (sums ``[N, *]``, the
    mask's sum per sample ``[N]``), in ``values``' dtype. Padding tokens contribute nothing, NaN included."""
    mask = loss_mask.to(device=values.device, dtype=values.dtype)
    weights = mask.reshape(-1, *([1] * (values.dim() - 1)))
    # where() rather than a product: a NaN/inf on a padding token must not leak into the sum.
    weighted = torch.where(weights > 0, values * weights, torch.zeros_like(values))
    sample_ids = sample_ids.to(values.device)
    sums = values.new_zeros(num_samples, *values.shape[1:]).index_add(0, sample_ids, weighted)
    return sums, values.new_zeros(num_samples).index_add(0, sample_ids, mask)
