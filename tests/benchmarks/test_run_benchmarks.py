"""Smoke test of the benchmark script on CPU: one tiny rung, dfm and reference, table written."""

import json

import pytest

from benchmarks import run_benchmarks
from benchmarks.ladders import LADDERS, get_ladder
from benchmarks.run_benchmarks import rung_config


@pytest.mark.parametrize("ladder", sorted(LADDERS))
def test_every_rung_builds_a_valid_config(ladder):
    for rung in get_ladder(ladder):
        cfg = rung_config(rung, [])
        assert cfg.dataset.seq_length >= 256, rung.name


def test_tiny_rung_times_both_sides_and_writes_the_table(tmp_path):
    run_benchmarks.main(["--ladder", "cpu", "--only", "tiny-256-mix", "--warmup", "0", "--steps", "1",
                         "--set", "model.num_layers=1", "--out", str(tmp_path)])
    row = json.loads((tmp_path / "results.json").read_text())["rows"][0]
    assert "error" not in row["dfm"] and "error" not in row["reference"]
    assert row["dfm"]["tokens_per_sec_per_gpu"] > 0 and row["ratio"] > 0
    assert "tiny-256-mix" in (tmp_path / "results.md").read_text()
