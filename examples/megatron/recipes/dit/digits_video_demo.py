"""The longer video "it learns" run (docs/learning.md): moving, captioned digits as .mp4 clips through the
real preparation, the real pretrain entry point for each model family (and pipeline), content, motion and
temporal-consistency scores at every saved checkpoint, then a learning-curve PNG, a GIF of generated clips
and a PNG strip of their frames.

    python examples/megatron/recipes/dit/digits_video_demo.py --out_dir outputs/digits_video_demo \
        --families stdit moviegen dit_cross --pipelines flow --eval_interval 300 \
        --plot docs/img/digits_video_learning.png --gif docs/img/digits_video_samples.gif \
        --strip docs/img/digits_video_frames.png train.train_iters=3000

Extra ``key=value`` arguments override the training config (conf/digits_video_tiny.yaml, the CI run's).
The CI-sized version of the same path is tests/learning/test_video_learn.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from digits.clips import ClipSpec
from digits.evaluate import sampling_from_args
from digits.plot import CLIP_PANELS, plot_clip_strips, plot_learning_curves, write_clip_gif
from digits.run import CLIP_CONFIG, demo_parser, prepare_digits, summarise, train_and_score_runs

FAMILIES = ("stdit", "moviegen", "dit_cross")


def build_parser() -> argparse.ArgumentParser:
    p = demo_parser(__doc__, "outputs/digits_video_demo", CLIP_CONFIG, ["flow"], eval_interval=300)
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    p.add_argument("--clips", type=int, default=None, help="how many clips to prepare (default: one per real digit)")
    p.set_defaults(samples_per_caption=4, steps=12)
    p.add_argument("--parallel", type=int, default=2, help="trainings at a time")
    p.add_argument("--plot", default=None, help="learning-curve PNG (default: OUT_DIR/digits_video_learning.png)")
    p.add_argument("--gif", default=None, help="animated clip grid (default: OUT_DIR/digits_video_samples.gif)")
    p.add_argument("--strip", default=None, help="frames as a PNG strip (default: OUT_DIR/digits_video_frames.png)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out_dir = Path(args.out_dir)
    sampling = sampling_from_args(args)
    prepare_digits(out_dir, clips=ClipSpec(), limit=args.clips)
    common = [f"checkpoint.save_interval={args.eval_interval}", *args.overrides]
    runs = {
        f"{family}-{pipeline}": [f"model.architecture={family}", f"model.pipeline={pipeline}", *common]
        for family in args.families
        for pipeline in args.pipelines
    }
    results = train_and_score_runs(out_dir, runs, Path(args.config), sampling, args.threads, args.parallel)
    summary = summarise(results)
    # The summary and the GIF (imageio only) first: the PNGs need matplotlib, an optional extra.
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    samples = {n: r.scores[-1]["samples"] for n, r in results.items()}
    gif = write_clip_gif(samples, sampling.samples_per_caption, args.gif or out_dir / "digits_video_samples.gif")
    curves = {n: (r.losses, r.scores) for n, r in results.items()}
    plot = plot_learning_curves(curves, args.plot or out_dir / "digits_video_learning.png", panels=CLIP_PANELS)
    strip = plot_clip_strips(samples, sampling.samples_per_caption, args.strip or out_dir / "digits_video_frames.png")
    print(f"wrote {plot}, {gif}, {strip}, {out_dir / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
