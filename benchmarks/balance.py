"""How evenly packs spread training FLOPs over data-parallel ranks and micro-batches (CPU, lengths only).

    python -m benchmarks.balance [--dp 8 --micro_batches 4 --seq_length 32768 --samples 8192]

A realistic image/video mix (256-token images to 16k-token videos, 50 % images) runs through the
mock loader's global pack stream twice: ``tokens`` (greedy in stream order, "before") and ``cost``
(packs of about equal FLOPs, "after"); for reference also first-fit decreasing on tokens over the
same windows (the energon loader's token packing). Global pack ``p`` goes to DP rank ``p % dp``
as in training; a step is ``dp * micro_batches`` consecutive packs. A step lasts as long as its busiest rank, so the reported
max/mean (summed over steps) is the time lost to imbalance: 1.00 is perfect.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from dfm.data.mock import MockDataSettings, MockPackedLoader, MockPacking, mock_sample_length
from dfm.data.pack_cost import PackCost
from dfm.data.pack_selection import first_fit_decreasing

# Latent sizes after an 8x VAE (4x in time); with 2x2 patches these are 256..4096-token images and
# 1280..16384-token clips (256p to 512p, 17 to 61 frames).
REALISTIC_MIX = MockDataSettings(
    seed=0,
    image_sizes=[(32, 32), (64, 64), (48, 80), (96, 96), (128, 128)],
    video_sizes=[(5, 32, 32), (9, 32, 48), (5, 64, 64), (9, 48, 80), (16, 64, 64)],
    image_fraction=0.5,
)


@dataclass
class Balance:
    per_rank: float  # sum over steps of the busiest rank's FLOPs / of the mean rank's
    per_micro_batch: float  # the same per (step, micro-batch) slot
    token_fill: float  # real tokens / (packs * seq_length)
    steps: int


def global_packs(balance: str, args: argparse.Namespace, cost: PackCost) -> list[list[int]]:
    """Token lengths of the global packs covering about ``args.samples`` samples, whole steps only."""
    loader = MockPackedLoader(
        REALISTIC_MIX, 0, 1, MockPacking(args.seq_length, balance=balance, cost=cost, window=args.window)
    )
    packs, used = [], 0
    while used < args.samples:
        pack = [mock_sample_length(REALISTIC_MIX, i) for i in loader.next_pack_indices()]
        packs.append(pack)
        used += len(pack)
    step = args.dp * args.micro_batches
    return packs[: len(packs) // step * step]


def first_fit_decreasing_packs(args: argparse.Namespace) -> list[list[int]]:
    """Token lengths of first-fit-decreasing packs over windows of the same stream, whole steps only."""
    packs, start = [], 0
    while start < args.samples:
        lengths = [mock_sample_length(REALISTIC_MIX, i) for i in range(start, start + args.window)]
        lengths = [n for n in lengths if n <= args.seq_length]
        packs += [[lengths[i] for i in pack] for pack in first_fit_decreasing(lengths, args.seq_length).packs]
        start += args.window
    step = args.dp * args.micro_batches
    return packs[: len(packs) // step * step]


def ratio(groups: list[list[float]]) -> float:
    return sum(max(g) for g in groups) / sum(sum(g) / len(g) for g in groups)


def measure(packs: list[list[int]], args: argparse.Namespace, cost: PackCost) -> Balance:
    costs = [cost.pack(p) for p in packs]
    dp, micro = args.dp, args.micro_batches
    steps = [costs[s : s + dp * micro] for s in range(0, len(costs), dp * micro)]
    # In a step, micro-batch k of rank r is pack k * dp + r.
    per_rank = [[sum(step[k * dp + r] for k in range(micro)) for r in range(dp)] for step in steps]
    per_slot = [step[k * dp : (k + 1) * dp] for step in steps for k in range(micro)]
    fill = sum(map(sum, packs)) / (len(packs) * args.seq_length)
    return Balance(ratio(per_rank), ratio(per_slot), fill, len(steps))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--micro_batches", type=int, default=4, help="per DP rank per step")
    parser.add_argument("--seq_length", type=int, default=32768)
    parser.add_argument("--window", type=int, default=256, help="samples per packing window (packing_buffer_size)")
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--hidden_size", type=int, default=4096, help="model width of the cost model")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Balance]:
    args = parse_args(argv)
    cost = PackCost.for_width(args.hidden_size)
    results = {balance: measure(global_packs(balance, args, cost), args, cost) for balance in ("tokens", "cost")}
    results["first_fit_decreasing"] = measure(first_fit_decreasing_packs(args), args, cost)
    before, after, ffd = results["tokens"], results["cost"], results["first_fit_decreasing"]
    print(
        f"dp {args.dp}, {args.micro_batches} micro-batches per rank, seq_length {args.seq_length}, "
        f"width {args.hidden_size}, {before.steps} / {after.steps} steps"
    )
    print(f"max/mean FLOPs per DP rank: before {before.per_rank:.2f}, after {after.per_rank:.2f}")
    print(f"max/mean FLOPs per micro-batch: before {before.per_micro_batch:.2f}, after {after.per_micro_batch:.2f}")
    print(f"token fill: before {before.token_fill:.3f}, after {after.token_fill:.3f}")
    print(
        f"first-fit decreasing on tokens: max/mean per DP rank {ffd.per_rank:.2f}, per micro-batch "
        f"{ffd.per_micro_batch:.2f}, token fill {ffd.token_fill:.3f}"
    )
    return results


if __name__ == "__main__":
    main()
