"""dfm against a plain PyTorch DiT on the moving-digits clips, at one size and budget (issue #44).

    python -m benchmarks.learning_parity --out_dir outputs/learning_parity --clips 500 --iterations 1500

Prepares the clips once (``digits.run.prepare_digits``: tiny T5, identity VAE, energon shards), trains
dfm through its real entry point with conf/digits_video_tiny.yaml (``digits.run.train_and_score``), then
the reference (benchmarks/learning_reference.py) on the same shards with the same config's
hyper-parameters, scores both with the digits scorer (same prompts, starting noise, steps and guidance)
and prints one table. Both sides run one after the other, each on ``--threads`` threads; minutes are
training plus scoring (dfm's include its two child processes' start-up). The summary goes to
``OUT_DIR/learning_parity.json``; with ``--curve_every N`` each side is also scored every N iterations (dfm
saves a checkpoint there, the reference copies its weights) and the JSON holds both learning curves.
``--out_dir`` must not hold an earlier run's ``dfm`` folder (its
checkpoints would be scored again); a prepared ``dataset`` there is reused as it is.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make `benchmarks` and `dfm` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.learning_reference import read_clip_shards, score_reference, train_reference
from dfm.config.loader import build_config
from dfm.data.patchify import num_tokens

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples/megatron/recipes/dit"))  # `digits` lives there

from digits.clips import ClipSpec
from digits.evaluate import DigitSampling
from digits.run import CLIP_CONFIG, prepare_digits, train_and_score

SCORE_COLUMNS = {  # table heading -> the scorer's key
    "content": "conditional_accuracy",
    "motion": "motion_accuracy",
    "consistency": "temporal_consistency",
    "uncond content": "unconditional_accuracy",
    "uncond motion": "unconditional_motion_accuracy",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", default="outputs/learning_parity")
    p.add_argument("--clips", type=int, default=500, help="moving-digit clips to prepare (the CI run's 500)")
    p.add_argument("--random_start", action="store_true", help="paths start anywhere (default: centred)")
    p.add_argument("--seed", type=int, default=1234, help="training seed of both sides (dfm's rng.seed)")
    p.add_argument("--iterations", type=int, default=1500)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    defaults = DigitSampling()
    p.add_argument("--samples_per_caption", type=int, default=10, help="per (digit, motion) caption, 50 captions")
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--guidance_scale", type=float, default=defaults.guidance_scale)
    p.add_argument("--threads", type=int, default=1, help="torch threads of each side")
    p.add_argument("--sides", choices=("both", "dfm", "reference"), default="both", help="which side(s) to train")
    p.add_argument(
        "--curve_every", type=int, default=0, help="also score both sides every N iterations (a learning curve)"
    )
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an extra dotted override of the config both sides train (e.g. scheduler.lr_decay_style=cosine)",
    )
    p.add_argument(
        "--dfm_override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an extra dotted override of dfm's config only (an ablation; the reference keeps the defaults)",
    )
    return p


def run_reference(
    root: Path, overrides: Sequence[str], sampling: DigitSampling, seed: int, threads: int, curve_every: int = 0
) -> dict:
    """Train and score the reference on ``root/dataset`` with the config dfm trains -> a summary row (with
    ``curve_every``, its ``curve``: the scores every that many iterations)."""
    cfg = build_config(None, str(CLIP_CONFIG), overrides)
    torch.set_num_threads(threads)
    start = time.perf_counter()
    m = cfg.model
    tokens_per_clip = num_tokens((m.in_channels, *m.max_latent_thw), m.patch_temporal, m.patch_spatial)
    # dfm's pack: seq_length tokens of whole clips (64 of the CI clips), at most packing_buffer_size of them.
    batch_size = min(cfg.dataset.seq_length // tokens_per_clip, cfg.dataset.packing_buffer_size)
    run = train_reference(read_clip_shards(root / "dataset"), cfg, batch_size, seed, curve_every)
    curve = snapshot_curve(run.model, run.snapshots, lambda model: score_reference(model, root, cfg, sampling))
    scores = score_reference(run.model, root, cfg, sampling)
    curve.append(curve_point(cfg.train.train_iters, scores))
    return row(scores, run.losses, time.perf_counter() - start, batch_size=batch_size, curve=curve)


def snapshot_curve(model: torch.nn.Module, snapshots: dict[int, dict], score) -> list[dict]:
    """``score(model)`` with each snapshot's weights loaded, in iteration order; then the model's own
    weights back (copied first: ``state_dict`` shares the parameters' storage, which loading overwrites)."""
    own = {name: value.detach().clone() for name, value in model.state_dict().items()}
    curve = []
    for iteration, weights in sorted(snapshots.items()):
        model.load_state_dict(weights)
        curve.append(curve_point(iteration, score(model)))
    model.load_state_dict(own)
    return curve


def curve_point(iteration: int, scores: dict) -> dict:
    """One point of a learning curve: the iteration and its scores."""
    return {"iteration": iteration, **{k: scores[k] for k in SCORE_COLUMNS.values()}}


def late_loss(losses: Sequence[tuple[int, float]]) -> float:
    """Mean training loss over the last tenth of the iterations (of those logged)."""
    last = losses[-1][0]
    late = [loss for iteration, loss in losses if iteration > 0.9 * last]
    return sum(late) / len(late)


def row(scores: dict, losses: Sequence[tuple[int, float]], seconds: float, **extra) -> dict:
    return {
        **{k: scores[k] for k in SCORE_COLUMNS.values()},
        "late_loss": late_loss(losses),
        "minutes": seconds / 60,
        **extra,
    }


def table(rows: dict[str, dict]) -> str:
    """One line per model: the scores, the late training loss and the minutes."""
    headings = ["model", *SCORE_COLUMNS, "late loss", "minutes"]
    lines = [" | ".join(headings), " | ".join("---" for _ in headings)]
    for name, r in rows.items():
        figures = [f"{r[key]:.2f}" for key in SCORE_COLUMNS.values()] + [f"{r['late_loss']:.3f}", f"{r['minutes']:.1f}"]
        lines.append(" | ".join([name, *figures]))
    return "\n".join(f"| {line} |" for line in lines)


def main(argv: Sequence[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    root = Path(args.out_dir)
    if args.sides != "reference" and (root / "dfm").exists():
        raise SystemExit(f"{root / 'dfm'} holds an earlier run: pick another --out_dir or remove it")
    spec = ClipSpec(random_start=args.random_start)
    prepare_digits(root, clips=spec, limit=args.clips)
    sampling = DigitSampling(args.samples_per_caption, args.steps, args.guidance_scale, None, args.seed)
    overrides = [
        f"model.hidden_size={args.hidden}",
        f"model.num_layers={args.layers}",
        f"train.train_iters={args.iterations}",
        f"rng.seed={args.seed}",
        *args.override,
    ]
    rows = {}
    if args.sides in ("both", "dfm"):
        # No time limit: at the size a side takes about an hour on a shared 2-core machine.
        curve = [f"checkpoint.save_interval={args.curve_every}"] if args.curve_every else []
        dfm_overrides = [*overrides, *curve, *args.dfm_override]
        dfm_run = train_and_score(root, "dfm", CLIP_CONFIG, dfm_overrides, sampling, args.threads, timeout=None)
        points = [curve_point(s["iteration"], s) for s in dfm_run.scores]
        rows["dfm"] = row(dfm_run.scores[-1], dfm_run.losses, dfm_run.seconds, curve=points)
    if args.sides in ("both", "reference"):
        rows["reference"] = run_reference(root, overrides, sampling, args.seed, args.threads, args.curve_every)
    print(table(rows))
    summary = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python -m benchmarks.learning_parity", *(argv if argv is not None else sys.argv[1:])]),
        "machine": f"{platform.processor() or platform.machine()}, {args.threads} thread(s) per side",
        "clips": asdict(spec) | {"count": args.clips},
        "overrides": overrides,
        "dfm_overrides": args.dfm_override,
        "sampling": asdict(sampling),
        "rows": rows,
    }
    (root / "learning_parity.json").write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
