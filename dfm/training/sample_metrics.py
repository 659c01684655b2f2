"""Numbers computed from the decoded validation samples (``validation.metrics``), logged with the
validation losses: ``validation.jsonl`` keys ``<metric>/<name>``, TensorBoard / W&B ``validation/<metric>/<name>``.

A metric is a function of the samples (prompt, frames [T, H, W, 3] uint8) returning named floats, looked
up by name in this registry: a config names metrics, it never names code to import (configs are data).
Your own metric (a classifier's accuracy, FID against your reference statistics with your feature
extractor): ``register("name", fn)`` in a launcher of your own that then calls the entry point's
``main`` (docs/training.md "Validation").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

SampleMetric = Callable[[Sequence], dict[str, float]]


def pixel_stats(samples: Sequence) -> dict[str, float]:
    """Mean and std of the pixels (0-255) over every sample, and their diversity: the mean pixel distance
    between pairs of samples of one size divided by the pixels' std (0: every sample the same; a
    collapsing model drifts there)."""
    pixels = [s.frames.astype(np.float64) for s in samples]
    everything = np.concatenate([p.ravel() for p in pixels])
    pairs = [np.abs(a - b).mean() for i, a in enumerate(pixels) for b in pixels[i + 1 :] if a.shape == b.shape]
    std = float(everything.std())
    diversity = float(np.mean(pairs)) / std if pairs and std > 0 else 0.0
    return {"mean": float(everything.mean()), "std": std, "diversity": diversity}


_METRICS: dict[str, SampleMetric] = {"pixel_stats": pixel_stats}


def register(name: str, metric: SampleMetric) -> None:
    """Make ``validation.metrics=[name]`` call ``metric(samples) -> {name: float}``."""
    _METRICS[name] = metric


def check_metrics(names: Sequence[str]) -> None:
    unknown = [name for name in names if name not in _METRICS]
    if unknown:
        raise ValueError(
            f"validation.metrics names {unknown}, not registered; known: {sorted(_METRICS)} "
            "(dfm.training.sample_metrics.register adds one)"
        )


def measure(names: Sequence[str], samples: Sequence) -> dict[str, float]:
    """``{"<metric>/<name>": value}`` of each named metric on ``samples``."""
    check_metrics(names)
    return {f"{name}/{key}": float(value) for name in names for key, value in _METRICS[name](samples).items()}
