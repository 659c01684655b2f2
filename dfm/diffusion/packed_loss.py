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
    mask = loss_mask.to(token_sums.dtype)
    # where() rather than a product: a NaN/inf on a padding token must not leak into the sum.
    token_sums = torch.where(mask > 0, token_sums * mask, torch.zeros_like(token_sums))
    sample_ids = sample_ids.to(token_sums.device)
    sums = torch.zeros(num_samples, dtype=token_sums.dtype, device=token_sums.device)
    sums = sums.index_add(0, sample_ids, token_sums)
    real_tokens = torch.zeros_like(sums).index_add(0, sample_ids, mask)
    denominators = real_tokens * features_per_token
    return sums / torch.where(denominators > 0, denominators, torch.ones_like(denominators))
