"""PNG figures of a digits run: loss and accuracy over iterations, and a grid of generated digits.

``runs`` maps a pipeline name to ``(losses, scores)``: losses ``[(iteration, loss)]`` from
``digits.run.read_losses`` and scores the list ``digits.evaluate`` writes (one dict per checkpoint).
Needs matplotlib (``pip install -e ".[demo]"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from digits.clips import MOTION_NAMES, clip_caption
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


@dataclass(frozen=True)
class ScorePanel:
    """One accuracy panel: a conditional and an unconditional score key of ``digits.evaluate``'s dicts."""

    conditional: str
    unconditional: str
    ylabel: str
    chance: float


DIGIT_PANELS = (ScorePanel("conditional_accuracy", "unconditional_accuracy", "classified as the prompted digit", 0.1),)
CLIP_PANELS = (
    ScorePanel("conditional_accuracy", "unconditional_accuracy", "clips showing the prompted digit", 0.1),
    ScorePanel("motion_accuracy", "unconditional_motion_accuracy", "clips moving as prompted", 0.2),
)


def plot_learning_curves(
    runs: dict[str, Run], path: str | Path, smooth: int = 10, panels: tuple[ScorePanel, ...] = DIGIT_PANELS
) -> Path:
    """Left: training loss (moving average); then one panel per score, conditional and unconditional."""
    plt = _pyplot()
    fig, (loss_ax, *score_axes) = plt.subplots(1, 1 + len(panels), figsize=(5.5 * (1 + len(panels)), 4))
    for name, (losses, scores) in runs.items():
        iterations, values = zip(*losses)
        color = loss_ax.plot(iterations, moving_average(list(values), smooth), label=name)[0].get_color()
        steps = [s["iteration"] for s in scores]
        for ax, panel in zip(score_axes, panels):
            ax.plot(steps, [s[panel.conditional] for s in scores], "o-", color=color, label=f"{name} conditional")
            ax.plot(steps, [s[panel.unconditional] for s in scores], "x--", color=color, label=f"{name} unconditional")
    loss_ax.set(xlabel="iteration", ylabel=f"training loss (mean of {smooth} logged)", title="loss")
    loss_ax.legend()
    for ax, panel in zip(score_axes, panels):
        ax.axhline(panel.chance, color="grey", linestyle=":", label="chance")
        ax.set(xlabel="iteration", ylabel=panel.ylabel, ylim=(0, 1), title=panel.conditional.replace("_", " "))
        ax.legend(fontsize="small")
    return _save(fig, path)


def plot_sample_grid(samples: dict[str, list], samples_per_caption: int, path: str | Path, columns: int = 8) -> Path:
    """One panel per pipeline: a row per prompted digit, ``columns`` generated samples each."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(samples), figsize=(3.2 * len(samples), 4.2), squeeze=False)
    for ax, (name, images) in zip(axes[0], samples.items()):
        rows = np.asarray(images).reshape(len(DIGIT_WORDS), samples_per_caption, 8, 8)[:, :columns]
        mosaic = np.pad(rows, ((0, 0), (0, 0), (1, 1), (1, 1))).transpose(0, 2, 1, 3).reshape(len(DIGIT_WORDS) * 10, -1)
        ax.imshow(mosaic, cmap="gray_r", vmin=0, vmax=DIGIT_MAX)
        ax.set_yticks(np.arange(len(DIGIT_WORDS)) * 10 + 4.5, [f"'{w}'" for w in DIGIT_WORDS], fontsize="small")
        ax.set_xticks([])
        ax.set_title(name)
    return _save(fig, path)


def clip_mosaics(clips: np.ndarray, rows: int, gap: int = 1) -> np.ndarray:
    """clips [rows * columns, T, H, W] -> frames [T, rows * (H + gap), columns * (W + gap)], row-major."""
    clips = np.pad(np.asarray(clips), ((0, 0), (0, 0), (0, gap), (0, gap)))
    n, t, h, w = clips.shape
    return clips.reshape(rows, n // rows, t, h, w).transpose(2, 0, 3, 1, 4).reshape(t, rows * h, -1)


def one_clip_per_caption(clips: list, samples_per_caption: int) -> np.ndarray:
    """Scores' ``samples`` [captions * samples_per_caption, T, H, W] -> the first clip of each caption."""
    return np.asarray(clips)[::samples_per_caption]


def write_clip_gif(samples: dict[str, list], samples_per_caption: int, path: str | Path, fps: int = 4) -> Path:
    """An animated grid: one panel per run side by side, each a row per digit and a column per motion."""
    import imageio.v2 as imageio

    panels = [clip_mosaics(one_clip_per_caption(c, samples_per_caption), len(DIGIT_WORDS)) for c in samples.values()]
    frames = np.concatenate([np.pad(p, ((0, 0), (0, 0), (0, 4))) for p in panels], axis=2)
    grey = 255 - np.round(np.clip(frames, 0, DIGIT_MAX) * 255 / DIGIT_MAX).astype(np.uint8)  # dark digits on white
    big = grey.repeat(2, axis=1).repeat(2, axis=2)  # 2x pixels: 16x16 clips are tiny on screen
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    imageio.mimsave(path, list(big), duration=1000 / fps, loop=0)
    return path


def plot_clip_strips(samples: dict[str, list], samples_per_caption: int, path: str | Path) -> Path:
    """One panel per run: a row per motion (shown with digits 0..4 in turn), the clip's frames left to right."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(samples), figsize=(3.6 * len(samples), 3.2), squeeze=False)
    motions = len(MOTION_NAMES)
    for ax, (name, clips) in zip(axes[0], samples.items()):
        firsts = one_clip_per_caption(clips, samples_per_caption)
        picked = np.stack([firsts[row * motions + row] for row in range(motions)])  # digit `row`, motion `row`
        frames = picked.reshape(-1, 1, *picked.shape[2:])  # each frame a one-frame clip: rows of frames
        strip, h = clip_mosaics(frames, motions)[0], picked.shape[2] + 1
        ax.imshow(strip, cmap="gray_r", vmin=0, vmax=DIGIT_MAX)
        captions = [clip_caption(row, MOTION_NAMES[row]).removeprefix("a handwritten ") for row in range(motions)]
        ax.set_yticks(np.arange(motions) * h + h / 2 - 1, captions, fontsize="small")
        ax.set_xticks([])
        ax.set_title(f"{name} (frames ->)")
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path
