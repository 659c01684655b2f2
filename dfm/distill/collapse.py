"""Mode-collapse figures of a batch of student samples, to log per student step.

Distribution matching is mode-seeking (a reverse KL): a student that collapses keeps a plausible
per-sample mean and std while its samples grow alike. The diversity figure catches that: the mean
pairwise distance between the batch's samples, relative to a reference batch (teacher samples or
data) when one is given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dfm.diffusion.packed_loss import masked_mean_per_sample, per_token
from dfm.diffusion.pipeline import at_least_fp32
from dfm.distill.batch import Packing, on_real_tokens


@dataclass
class CollapseStatistics:
    """Statistics of one batch of N samples."""

    mean: Tensor  # [N] each sample's mean over its real tokens and features
    std: Tensor  # [N] each sample's (population) std over the same
    pairwise_distance: float  # mean over pairs i < j of the RMS per-element distance
    diversity: float  # pairwise_distance / the reference batch's; pairwise_distance without a reference


def per_sample_mean_std(x: Tensor, packing: Packing) -> tuple[Tensor, Tensor]:
    """([N], [N]) mean and population std of each sample of ``x [S, *]`` over its real tokens."""
    x = at_least_fp32(x)
    mean = masked_mean_per_sample(x, packing.sample_ids, packing.loss_mask, packing.num_samples)
    centred = (x - per_token(mean, packing.sample_ids, x)) ** 2
    variance = masked_mean_per_sample(centred, packing.sample_ids, packing.loss_mask, packing.num_samples)
    return mean, variance.sqrt()


def samples_as_rows(x: Tensor, packing: Packing) -> Tensor:
    """[N, F]: each sample of ``x [S, *]`` flattened (padding zeroed); every sample must have as many tokens."""
    counts = torch.bincount(packing.sample_ids, minlength=packing.num_samples)
    if packing.num_samples < 2 or bool((counts != counts[0]).any()):
        raise ValueError(f"pairwise distances need >= 2 samples of one token count, got counts {counts.tolist()}")
    order = torch.argsort(packing.sample_ids, stable=True)
    return on_real_tokens(at_least_fp32(x), packing)[order].reshape(packing.num_samples, -1)


def mean_pairwise_distance(x: Tensor, packing: Packing) -> float:
    """Mean over pairs of samples of the RMS per-element distance (the L2 distance / sqrt(F))."""
    rows = samples_as_rows(x, packing)
    return float(torch.pdist(rows).mean() / rows.shape[1] ** 0.5)


def collapse_statistics(
    x: Tensor, packing: Packing, reference: Tensor | None = None, reference_packing: Packing | None = None
) -> CollapseStatistics:
    """Mean, std and diversity of the samples ``x [S, *]``; ``reference [S', *]`` is packed as
    ``reference_packing`` (default: as ``x``)."""
    mean, std = per_sample_mean_std(x, packing)
    distance = mean_pairwise_distance(x, packing)
    diversity = distance
    if reference is not None:
        diversity = distance / mean_pairwise_distance(reference, reference_packing or packing)
    return CollapseStatistics(mean, std, distance, diversity)


def per_step_collapse_statistics(
    trajectory: list[Tensor], packing: Packing, reference: Tensor | None = None
) -> list[CollapseStatistics]:
    """``collapse_statistics`` of each step's clean prediction (``student_trajectory``'s list)."""
    return [collapse_statistics(x0, packing, reference) for x0 in trajectory]


def same_shape_samples(packing: Packing, shapes: list[tuple[int, ...]]) -> tuple[Tensor, Packing] | None:
    """The samples of a pack's most common shape (``shapes``: one per sample, e.g. its latent's (C, T, H, W)),
    as (their tokens' indices [S'], their own Packing); None when no two samples share a shape. Pairwise
    distances compare samples element by element, so a pack of mixed sizes is measured on one size."""
    counts = {shape: shapes.count(shape) for shape in shapes}
    shape = max(counts, key=counts.get)
    if counts[shape] < 2:
        return None
    chosen = torch.tensor([i for i, s in enumerate(shapes) if s == shape], device=packing.sample_ids.device)
    tokens = torch.isin(packing.sample_ids, chosen).nonzero().squeeze(1)
    renumbered = torch.searchsorted(chosen, packing.sample_ids[tokens])
    return tokens, Packing(renumbered, packing.loss_mask[tokens], len(chosen))
