"""How varied generated digits are, and whether any copies a training digit.

A distilled (mode-seeking) student can reach the right class with one handwriting per digit, or by
memorising: accuracy sees neither. Both are measured in pixel space (0..16), per prompted digit:

    diversity ratio   mean pairwise distance of a digit's samples / that of the real digits of that class,
                      averaged over the digits (1: as varied as the data; a collapsed model: 0)
    near copies       fraction of samples whose nearest real digit is closer than ``NEAR_COPY_RMS``
    nearest ratio     median distance of a sample to its nearest real digit / the same for real digits
                      (leave-one-out): below 1, samples sit closer to the data than the data to itself
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from digits.data import load_digits

# RMS pixel distance (0..16 scale) under which a sample counts as a copy: less than one grey level per
# pixel on average. Real digits' nearest other real digit is 2.0 away (median; 1st percentile 1.17,
# 0.3 % of them below 1.0): a generated digit this close is closer than almost any two real ones.
NEAR_COPY_RMS = 1.0


@dataclass(frozen=True)
class DiversityScores:
    diversity_ratio: float
    near_copy_fraction: float
    nearest_ratio: float


def rms_distances(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """RMS pixel distance of every row of ``a [N, P]`` to every row of ``b [M, P]`` -> [N, M]."""
    squared = (a**2).sum(1)[:, None] + (b**2).sum(1)[None, :] - 2.0 * a @ b.T
    return np.sqrt(np.maximum(squared, 0.0) / a.shape[1])


def mean_pairwise_distance(images: np.ndarray) -> float:
    """Mean RMS distance over distinct pairs of ``images [N, P]`` (N >= 2)."""
    d = rms_distances(images, images)
    n = len(images)
    return float(d.sum() / (n * (n - 1)))


@functools.cache
def real_digits() -> tuple[np.ndarray, np.ndarray]:
    """The training digits flattened [1797, 64] (float64, 0..16) and their labels [1797]."""
    images, labels = load_digits()
    return images.reshape(len(images), -1).astype(np.float64), labels


@functools.cache
def real_nearest_median() -> float:
    """Median over real digits of the distance to their nearest other real digit."""
    images, _ = real_digits()
    d = rms_distances(images, images)
    np.fill_diagonal(d, np.inf)
    return float(np.median(d.min(1)))


def diversity_scores(samples: np.ndarray, digits: np.ndarray) -> DiversityScores:
    """``samples [N, 8, 8]`` in 0..16 generated for the prompted ``digits [N]`` -> their scores."""
    flat = samples.reshape(len(samples), -1).astype(np.float64)
    images, labels = real_digits()
    ratios = [
        mean_pairwise_distance(flat[digits == d]) / mean_pairwise_distance(images[labels == d])
        for d in np.unique(digits)
        if (digits == d).sum() >= 2
    ]
    nearest = rms_distances(flat, images).min(1)
    return DiversityScores(
        diversity_ratio=float(np.mean(ratios)),
        near_copy_fraction=float(np.mean(nearest < NEAR_COPY_RMS)),
        nearest_ratio=float(np.median(nearest) / real_nearest_median()),
    )
