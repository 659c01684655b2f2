"""One PNG of a run's curves from its log folder: training loss, validation loss per noise level and any
other validation numbers (sample metrics) over iterations.

    python -m dfm.training.plot <logger.log_dir> [--out curves.png]

Reads ``metrics.jsonl`` and ``validation.jsonl`` (what the training loop writes); needs matplotlib
(``pip install -e ".[demo]"``).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

LEVEL_KEY = re.compile(r"^val_loss_t(\d+)$")
NOT_METRICS = {"iteration", "val_loss", "val_levels", "generation", "samples"}


@dataclass
class Curves:
    """Series as (iterations, values): training loss, validation loss, per level k, other metrics."""

    loss: tuple[list[int], list[float]] = ([], [])
    val_loss: tuple[list[int], list[float]] = ([], [])
    levels: dict[int, tuple[float, list[int], list[float]]] = field(default_factory=dict)  # k -> (level, its, values)
    metrics: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["iteration"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [i for i, _ in points], [v for _, v in points]


def read_curves(log_dir: str | Path) -> Curves:
    """The curves of the run logged under ``log_dir``."""
    train = read_jsonl(Path(log_dir) / "metrics.jsonl")
    validation = read_jsonl(Path(log_dir) / "validation.jsonl")
    if not train and not validation:
        raise FileNotFoundError(f"{log_dir} holds no metrics.jsonl or validation.jsonl (logger.log_dir of a run)")
    curves = Curves(loss=series(train, "loss"), val_loss=series(validation, "val_loss"))
    for key in sorted({k for r in validation for k in r}, key=str):
        match = LEVEL_KEY.match(key)
        if match:
            k = int(match.group(1))
            level = next((r["val_levels"][k] for r in validation if len(r.get("val_levels", [])) > k), float(k))
            curves.levels[k] = (level, *series(validation, key))
        elif key not in NOT_METRICS and series(validation, key)[0]:
            curves.metrics[key] = series(validation, key)
    return curves


def plot_curves(curves: Curves, out: str | Path, title: str = "") -> Path:
    """Panels: losses, validation loss per level (low noise to high), other validation numbers."""
    try:
        import matplotlib
    except ImportError as error:
        raise SystemExit('plotting needs matplotlib: pip install -e ".[demo]"') from error
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    panels = 2 + bool(curves.metrics)
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4), squeeze=False)
    losses, per_level = axes[0][0], axes[0][1]
    losses.plot(*curves.loss, label="training loss", lw=0.8)
    if curves.val_loss[0]:
        losses.plot(*curves.val_loss, "o-", label="validation loss (mean over levels)")
    losses.set(xlabel="iteration", ylabel="loss", title=title or "loss")
    losses.legend()
    colours = plt.cm.viridis([k / max(1, len(curves.levels) - 1) for k in range(len(curves.levels))])
    for colour, (_, (level, its, values)) in zip(colours, sorted(curves.levels.items())):
        per_level.plot(its, values, "o-", color=colour, label=f"level {level:.3g}")
    per_level.set(xlabel="iteration", ylabel="validation loss", title="validation loss per noise level")
    if curves.levels:
        per_level.legend(fontsize="small")
    if curves.metrics:
        for key, (its, values) in curves.metrics.items():
            axes[0][2].plot(its, values, "o-", label=key)
        axes[0][2].set(xlabel="iteration", title="validation metrics")
        axes[0][2].legend(fontsize="small")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log_dir", help="a run's logger.log_dir")
    parser.add_argument("--out", default=None, help="the PNG (default: <log_dir>/curves.png)")
    args = parser.parse_args(argv)
    out = plot_curves(read_curves(args.log_dir), args.out or Path(args.log_dir) / "curves.png", Path(args.log_dir).name)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
