"""The packing-balance benchmark runs on CPU and prints its result line."""

import re

from benchmarks import balance


def test_balance_benchmark_prints_before_and_after(capsys):
    results = balance.main(["--samples", "1024", "--dp", "4", "--micro_batches", "2"])
    out = capsys.readouterr().out
    assert re.search(r"max/mean FLOPs per DP rank: before \d+\.\d\d, after \d+\.\d\d", out)
    assert re.search(r"max/mean FLOPs per micro-batch: before \d+\.\d\d, after \d+\.\d\d", out)
    assert results["cost"].per_rank <= results["tokens"].per_rank
