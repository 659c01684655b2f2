"""The longer "it learns" run (docs/learning.md): scikit-learn's digits through the real preparation,
the real pretrain entry point for each pipeline, conditional/unconditional accuracy at every saved
checkpoint, then the learning-curve and sample-grid PNGs.

    python examples/megatron/recipes/dit/digits_demo.py --out_dir outputs/digits_demo --eval_interval 200 \
        --plot docs/img/digits_learning.png --grid docs/img/digits_samples.png train.train_iters=800

Extra ``key=value`` arguments override the training config (conf/digits_tiny.yaml, the CI run's,
which trains 500 iterations), e.g. ``train.train_iters=1500``. The CI-sized version of the same path
is tests/learning/test_digits_learn.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from digits.evaluate import sampling_from_args
from digits.plot import plot_learning_curves, plot_sample_grid
from digits.run import CI_CONFIG, demo_parser, prepare_digits, summarise, train_and_score_pipelines


def build_parser() -> argparse.ArgumentParser:
    p = demo_parser(__doc__, "outputs/digits_demo", CI_CONFIG, ["edm", "flow"], eval_interval=250)
    p.add_argument("--plot", default=None, help="learning-curve PNG (default: OUT_DIR/digits_learning.png)")
    p.add_argument("--grid", default=None, help="sample-grid PNG (default: OUT_DIR/digits_samples.png)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out_dir = Path(args.out_dir)
    sampling = sampling_from_args(args)
    prepare_digits(out_dir)
    overrides = [f"checkpoint.save_interval={args.eval_interval}", *args.overrides]
    runs = train_and_score_pipelines(out_dir, args.pipelines, Path(args.config), overrides, sampling, args.threads)
    summary = summarise(runs)
    plot = plot_learning_curves(
        {n: (r.losses, r.scores) for n, r in runs.items()}, args.plot or out_dir / "digits_learning.png"
    )
    grid = plot_sample_grid(
        {n: r.scores[-1]["samples"] for n, r in runs.items()},
        args.samples_per_caption,
        args.grid or out_dir / "digits_samples.png",
    )
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {plot}, {grid}, {out_dir / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
