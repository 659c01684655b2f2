"""Prepare an energon dataset from a local folder of images/videos and captions.

    python examples/megatron/recipes/dit/prepare_energon_dataset.py \
        --input_dir raw/ --output_dir data/ --resolution_preset 256p --run_energon_prepare

FLUX.1 (T5 padded to --max_text_len as FluxPipeline encodes it, CLIP's pooled vector, FLUX's VAE), all
from a downloaded FLUX.1-dev folder:

    ... --encoders flux --t5 FLUX.1-dev --clip FLUX.1-dev --vae FLUX.1-dev --max_text_len 512

Multi-process: ``torchrun --nproc_per_node 8 ... prepare_energon_dataset.py ...`` (each rank writes
its own shards), then ``energon prepare`` once (see docs/data.md).

The output folder must be new or empty; ``--overwrite`` clears a previous preparation first,
``--resume`` continues an interrupted one without duplicating samples.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from dfm.data.prepare.buckets import RESOLUTION_PRESETS
from dfm.data.prepare.captions import CAPTION_FORMATS
from dfm.data.prepare.pipeline import (
    DEFAULT_T5,
    DEFAULT_VAE,
    PreparationError,
    PrepareSettings,
    prepare_dataset,
    settings_from_env,
)
from dfm.platform.process_exit import skip_final_gc_at_exit


def add_encoding_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared with the other preparation scripts (resolution, encoders, shards)."""
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--resolution_preset", choices=sorted(RESOLUTION_PRESETS))
    size.add_argument("--max_pixels", type=int)
    size.add_argument("--height", type=int, help="fixed bucket height (with --width)")
    parser.add_argument("--width", type=int)
    parser.add_argument("--num_frames", type=int, default=17, help="frames per video before VAE compression")
    parser.add_argument("--frame_stride", type=int, default=1)
    parser.add_argument("--patch_spatial", type=int, default=2)
    parser.add_argument("--t5", default=DEFAULT_T5, help="T5 hub name or local folder")
    parser.add_argument("--t5_cache_dir")
    parser.add_argument("--max_text_len", type=int, default=512)
    parser.add_argument("--vae", default=DEFAULT_VAE, help="VAE hub name or local folder")
    parser.add_argument("--vae_subfolder", default="vae", help="'' for a folder that is the VAE itself")
    parser.add_argument(
        "--vae_kind", choices=["auto", "wan", "wan22", "kl"], default="auto", help="wan22: Wan 2.2's VAE (z_dim 48)"
    )
    parser.add_argument("--vae_cache_dir")
    parser.add_argument(
        "--first_frame_clean",
        action="store_true",
        help="Wan 2.2 TI2V: the samples train image-to-video, their first latent frame the clean condition",
    )
    parser.add_argument(
        "--wan_image_condition",
        action="store_true",
        help="Wan 2.2 I2V-A14B: store each sample's image-condition latent (the VAE's of its first frame then "
        "zero frames) for model.wan_image_condition",
    )
    parser.add_argument(
        "--encoders",
        choices=["t5", "flux", "hunyuan_video15"],
        default="t5",
        help="t5: unpadded T5 text (DiT, Wan); flux: FLUX.1's full-length T5, CLIP's pooled vector, its KL VAE; "
        "hunyuan_video15: HunyuanVideo 1.5's Qwen2.5-VL + ByT5 text, VAE, first-frame latent and SigLIP (--hunyuan)",
    )
    parser.add_argument(
        "--hunyuan", help="HunyuanVideo 1.5 image-to-video pipeline folder (--encoders hunyuan_video15)"
    )
    parser.add_argument("--clip", help="CLIP text encoder folder or FLUX.1 pipeline folder (--encoders flux)")
    parser.add_argument("--tiny_random_encoders", action="store_true", help="tiny random T5 (+ CLIP) + VAE (tests)")
    parser.add_argument("--shard_maxcount", type=int, default=1000)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--run_energon_prepare", action="store_true", help="run `energon prepare` afterwards")
    existing = parser.add_mutually_exclusive_group()
    existing.add_argument(
        "--overwrite", action="store_true", help="clear a previous preparation's shards and energon index first"
    )
    existing.add_argument("--resume", action="store_true", help="continue an interrupted preparation (same arguments)")
    parser.add_argument(
        "--max_skip_fraction",
        type=float,
        default=0.05,
        help="fail (after the report) when more of a rank's files than this are unreadable",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input_dir", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--caption_format", choices=CAPTION_FORMATS, help="default: try all, then the file name")
    add_encoding_arguments(parser)
    return parser


def settings_from_args(args: argparse.Namespace, input_dir: str | None = None) -> PrepareSettings:
    if (args.height is None) != (args.width is None):
        raise SystemExit("--height and --width go together")
    return settings_from_env(
        PrepareSettings(
            input_dir=input_dir or args.input_dir,
            output_dir=args.output_dir,
            caption_format=getattr(args, "caption_format", None),
            resolution_preset=args.resolution_preset,
            max_pixels=args.max_pixels,
            height=args.height,
            width=args.width,
            num_frames=args.num_frames,
            frame_stride=args.frame_stride,
            patch_spatial=args.patch_spatial,
            t5_name_or_dir=args.t5,
            t5_cache_dir=args.t5_cache_dir,
            max_text_len=args.max_text_len,
            vae_name_or_dir=args.vae,
            vae_subfolder=args.vae_subfolder or None,
            vae_kind=args.vae_kind,
            vae_cache_dir=args.vae_cache_dir,
            encoders=args.encoders,
            clip_name_or_dir=args.clip,
            hunyuan_name_or_dir=args.hunyuan,
            tiny_random_encoders=args.tiny_random_encoders,
            shard_maxcount=args.shard_maxcount,
            device=args.device,
            run_energon_prepare=args.run_energon_prepare,
            overwrite=args.overwrite,
            resume=args.resume,
            max_skip_fraction=args.max_skip_fraction,
            first_frame_clean=args.first_frame_clean,
            wan_image_condition=args.wan_image_condition,
        )
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        report = prepare_dataset(settings_from_args(build_parser().parse_args(argv)))
    except (PreparationError, FileNotFoundError) as error:  # named file and reason, no traceback needed
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(report.summary())
    return 0 if report.written > 0 else 1


if __name__ == "__main__":
    skip_final_gc_at_exit()
    sys.exit(main())
