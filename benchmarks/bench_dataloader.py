"""Throughput of the energon loader + DiffusionTaskEncoder (cook, patchify, pack, the samples' training draws)
on synthetic shards.

    python benchmarks/bench_dataloader.py --num_workers 0 1 2

Writes a synthetic energon dataset (mock latents and T5-sized text embeddings) to a temporary
folder, then for each worker count reports samples/s, tokens/s, per-worker rates and packing efficiency.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

from dfm.data.energon.data_module import EnergonDataSettings, build_train_loader
from dfm.data.energon.task_encoder import PackingSettings
from dfm.data.mock import MockDataSettings
from dfm.data.pack_draws import DrawSettings
from dfm.data.pack_selection import packing_efficiency
from dfm.data.prepare.synthetic import write_synthetic_dataset


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_samples", type=int, default=512, help="samples in the synthetic dataset")
    parser.add_argument("--num_workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--packs", type=int, default=60, help="packs timed per run (after warm-up)")
    parser.add_argument("--warmup_packs", type=int, default=5)
    parser.add_argument("--seq_length", type=int, default=8192)
    parser.add_argument("--packing_buffer_size", type=int, default=256)
    parser.add_argument("--text_embed_dim", type=int, default=4096, help="T5-XXL width")
    parser.add_argument("--dataset_dir", help="reuse / write the dataset here instead of a temp folder")
    return parser.parse_args()


def synthetic_settings(text_embed_dim: int) -> MockDataSettings:
    # 16-channel latents of 256p-like buckets (after an 8x VAE) and short clips; T5 captions of 8-120 tokens.
    return MockDataSettings(
        seed=0,
        image_sizes=[(32, 32), (32, 48), (48, 32)],
        video_sizes=[(5, 32, 32), (5, 32, 48)],
        image_fraction=0.5,
        text_len_range=(8, 120),
        in_channels=16,
        text_embed_dim=text_embed_dim,
    )


def time_loader(dataset: Path, num_workers: int, args: argparse.Namespace) -> dict:
    settings = EnergonDataSettings(
        path=str(dataset),
        # With the training draws, as the trainer's loader makes them (one level number a sample: EDM, flow's logit-normal).
        packing=PackingSettings(seq_length=args.seq_length, max_text_len=512, draws=DrawSettings(0, ("normal",))),
        packing_buffer_size=args.packing_buffer_size,
        num_workers=num_workers,
        shuffle_buffer_size=100,
    )
    loader = build_train_loader(settings, dp_rank=0, dp_size=1)
    for _ in range(args.warmup_packs):  # includes filling the first packing buffer
        next(loader)
    start = time.perf_counter()
    batches = [next(loader) for _ in range(args.packs)]
    elapsed = time.perf_counter() - start
    samples = sum(b.num_samples for b in batches)
    tokens = sum(b.num_real_tokens() for b in batches)
    workers = max(num_workers, 1)
    return {
        "num_workers": num_workers,
        "samples_per_s": samples / elapsed,
        "tokens_per_s": tokens / elapsed,
        "samples_per_s_per_worker": samples / elapsed / workers,
        "tokens_per_s_per_worker": tokens / elapsed / workers,
        "packs_per_s": args.packs / elapsed,
        "packing_efficiency": packing_efficiency(batches, args.seq_length),
    }


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dataset = Path(args.dataset_dir or tmp) / "bench_dataset"
        if not (dataset / ".nv-meta").is_dir():
            write_synthetic_dataset(
                dataset, args.num_samples, synthetic_settings(args.text_embed_dim), shard_maxcount=64
            )
        print("workers  samples/s  tokens/s  samples/s/worker  tokens/s/worker  packs/s  efficiency")
        for num_workers in args.num_workers:
            r = time_loader(dataset, num_workers, args)
            print(
                f"{r['num_workers']:7d}  {r['samples_per_s']:9.1f}  {r['tokens_per_s']:8.0f}  "
                f"{r['samples_per_s_per_worker']:16.1f}  {r['tokens_per_s_per_worker']:15.0f}  "
                f"{r['packs_per_s']:7.2f}  {r['packing_efficiency']:10.4f}"
            )


if __name__ == "__main__":
    main()
