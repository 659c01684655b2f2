"""Packing efficiency over random mixed streams: the distribution behind the bound that
tests/data/test_packing.py asserts (docs/data.md).

    python -m benchmarks.packing_draws [--draws 500 --seed 1 --max_image_fraction 0.8]

Each draw: a mock stream of 3 x 256 samples (the default packing buffer, fed buffer by buffer as
energon's PackingDataset does), a random seed, image fraction in [0.2, max_image_fraction], CP 1 or 2,
balance by tokens or by cost; efficiency = real tokens / (packs x seq_length 8192). About 1 s per draw
on one CPU core.
"""

from __future__ import annotations

import argparse
import random
import statistics

from dfm.data.energon.data_module import EnergonDataSettings
from dfm.data.energon.task_encoder import DiffusionTaskEncoder, PackingSettings
from dfm.data.mock import MockDataSettings, mock_sample
from dfm.data.pack_selection import packing_efficiency

DEFAULT_BUFFER = EnergonDataSettings.__dataclass_fields__["packing_buffer_size"].default
SEQ_LENGTH = 8192
# Images 256-1024 tokens, videos 1024-4096 (patch 2); channels do not change token counts.
MIXED = dict(
    image_sizes=[(32, 32), (32, 48), (48, 32), (64, 64), (48, 64)],
    video_sizes=[(4, 32, 32), (8, 32, 48), (16, 32, 32), (4, 48, 64)],
    in_channels=1,
    text_embed_dim=4,
)


def mixed_stream_efficiency(seed: int, image_fraction: float, cp: int, balance: str) -> float:
    mock = MockDataSettings(seed=seed, image_fraction=image_fraction, **MIXED)
    packing = PackingSettings(seq_length=SEQ_LENGTH, segment_multiple=2 * cp, total_multiple=cp, balance=balance)
    encoder = DiffusionTaskEncoder(packing)
    stream = [mock_sample(mock, i) for i in range(3 * DEFAULT_BUFFER)]
    batches = []
    for start in range(0, len(stream), DEFAULT_BUFFER):
        buffer = stream[start : start + DEFAULT_BUFFER]
        batches += [encoder.pack_selected_samples(p) for p in encoder.select_samples_to_pack(buffer)]
    return packing_efficiency(batches, SEQ_LENGTH)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draws", type=int, default=500)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max_image_fraction", type=float, default=0.8)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    results = []
    for _ in range(args.draws):
        draw = (rng.randrange(2**31), rng.uniform(0.2, args.max_image_fraction), rng.choice([1, 2]))
        balance = rng.choice(["cost", "tokens"])
        results.append((mixed_stream_efficiency(*draw, balance), *draw, balance))
    for balance in ("cost", "tokens"):
        values = sorted(r[0] for r in results if r[-1] == balance)
        if len(values) > 1:
            print(
                f"{balance}: {len(values)} draws, min {values[0]:.4f}, 1st percentile {values[len(values) // 100]:.4f}, "
                f"median {statistics.median(values):.4f}, mean {statistics.mean(values):.4f}, "
                f"sd {statistics.stdev(values):.4f}"
            )
    for efficiency, seed, fraction, cp, balance in sorted(results)[:5]:
        print(f"  {efficiency:.4f}: seed {seed}, image fraction {fraction:.3f}, cp {cp}, {balance}")


if __name__ == "__main__":
    main()
