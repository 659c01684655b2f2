"""Prepare an energon dataset from Hugging Face ``huggan/smithsonian_butterflies_subset``.

Needs internet and the ``datasets`` package. The images are written to a staging folder with a
``captions.jsonl``, then encoded by the same core as prepare_energon_dataset.py:

    python examples/megatron/recipes/dit/prepare_energon_dataset_butterfly.py \
        --output_dir data/butterflies --resolution_preset 256p --run_energon_prepare
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
from pathlib import Path

from dfm.data.prepare.pipeline import prepare_dataset

DATASET = "huggan/smithsonian_butterflies_subset"


def _load_sibling(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--dataset", default=DATASET)
    parser.add_argument("--split", default="train")
    parser.add_argument("--hf_cache_dir")
    parser.add_argument("--staging_dir", help="where the images are written (default: OUTPUT_DIR/../NAME_raw)")
    parser.add_argument("--max_samples", type=int, help="only the first N rows")
    _load_sibling("prepare_energon_dataset").add_encoding_arguments(parser)
    return parser


def butterfly_caption(row: dict) -> str:
    name = row.get("name") or row.get("common_name") or "butterfly"
    scientific = row.get("scientific_name") or row.get("sci_name")
    return f"a photo of a {name} butterfly" + (f" ({scientific})" if scientific else "")


def stage_images(args: argparse.Namespace) -> Path:
    """Write the dataset's images as PNGs plus a captions.jsonl into the staging folder."""
    from datasets import load_dataset  # optional dependency, only this script needs it

    rows = load_dataset(args.dataset, split=args.split, cache_dir=args.hf_cache_dir)
    if args.max_samples is not None:
        rows = rows.select(range(min(args.max_samples, len(rows))))
    staging = Path(args.staging_dir or Path(args.output_dir).parent / f"{Path(args.output_dir).name}_raw")
    staging.mkdir(parents=True, exist_ok=True)
    with open(staging / "captions.jsonl", "w") as captions:
        for index, row in enumerate(rows):
            file_name = f"butterfly_{index:06d}.png"
            row["image"].convert("RGB").save(staging / file_name)
            captions.write(json.dumps({"file": file_name, "caption": butterfly_caption(row)}) + "\n")
    return staging


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    args.caption_format = "jsonl"
    staging = stage_images(args)
    settings = _load_sibling("prepare_energon_dataset").settings_from_args(args, input_dir=str(staging))
    report = prepare_dataset(settings)
    print(report.summary())
    return 0 if report.written > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
