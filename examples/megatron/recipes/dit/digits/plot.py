"""PNG figures of a digits run: loss and accuracy over iterations, and a grid of generated digits.

``runs`` maps a pipeline name to ``(losses, scores)``: losses ``[(iteration, loss)]`` from
``digits.run.read_losses`` and scores the list ``digits.evaluate`` writes (one dict per checkpoint).
Needs matplotlib (``pip install -e ".[demo]"``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from digits.data import DIGIT_MAX, DIGIT_WORDS

Run = tuple[list[tuple[int, float]], list[dict]]


def _pyplot():
    try:
        import matplotlib
    except ImportError as error:
        raise SystemExit('the digits figures need matplotlib: pip install -e ".[demo]"') from error

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def moving_average(values: list[float], window: int) -> np.ndarray:
    """Trailing mean over ``window`` points (shorter at the start): the per-step loss is noisy."""
    cumulative = np.cumsum(np.insert(np.asarray(values, dtype=np.float64), 0, 0.0))
    counts = np.minimum(np.arange(1, len(values) + 1), window)
    return (cumulative[1:] - cumulative[np.arange(1, len(values) + 1) - counts]) / counts


def plot_learning_curves(runs: dict[str, Run], path: str | Path, smooth: int = 10) -> Path:
    """Left: training loss (moving average); right: conditional and unconditional accuracy."""
    plt = _pyplot()
    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for name, (losses, scores) in runs.items():
        iterations, values = zip(*losses)
        line = loss_ax.plot(iterations, moving_average(list(values), smooth), label=name)[0]
        steps = [s["iteration"] for s in scores]
        acc_ax.plot(
            steps,
            [s["conditional_accuracy"] for s in scores],
            "o-",
            color=line.get_color(),
            label=f"{name} conditional",
        )
        acc_ax.plot(
            steps,
            [s["unconditional_accuracy"] for s in scores],
            "x--",
            color=line.get_color(),
            label=f"{name} unconditional",
        )
    loss_ax.set(xlabel="iteration", ylabel=f"training loss (mean of {smooth} logged)", title="loss")
    acc_ax.axhline(1 / len(DIGIT_WORDS), color="grey", linestyle=":", label="chance")
    acc_ax.set(xlabel="iteration", ylabel="classified as the prompted digit", ylim=(0, 1), title="accuracy")
    loss_ax.legend()
    acc_ax.legend(fontsize="small")
    return _save(fig, path)


def plot_sample_grid(samples: dict[str, list], samples_per_digit: int, path: str | Path, columns: int = 8) -> Path:
    """One panel per pipeline: a row per prompted digit, ``columns`` generated samples each."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(samples), figsize=(3.2 * len(samples), 4.2), squeeze=False)
    for ax, (name, images) in zip(axes[0], samples.items()):
        rows = np.asarray(images).reshape(len(DIGIT_WORDS), samples_per_digit, 8, 8)[:, :columns]
        mosaic = np.pad(rows, ((0, 0), (0, 0), (1, 1), (1, 1))).transpose(0, 2, 1, 3).reshape(len(DIGIT_WORDS) * 10, -1)
        ax.imshow(mosaic, cmap="gray_r", vmin=0, vmax=DIGIT_MAX)
        ax.set_yticks(np.arange(len(DIGIT_WORDS)) * 10 + 4.5, [f"'{w}'" for w in DIGIT_WORDS], fontsize="small")
        ax.set_xticks([])
        ax.set_title(name)
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path
