"""benchmarks.memory_phases on one tiny case (the real entry point, one process): every rank's peak and
state are read back and reported in the benchmark's line format; the parsing and the FSDP ratio on
known numbers. The full benchmark (0.22B model, DP=2/4) is not run in CI."""

from __future__ import annotations

import re

import pytest

from benchmarks.memory_phases import (
    Peaks,
    case_line,
    fsdp_ratio_line,
    import_baseline,
    measure,
    parse_states,
    peaks_of,
)
from dfm.training.memory import STATE_LOG_KEY


@pytest.mark.slow
def test_one_tiny_case_reports_peak_over_state():
    # Whole-process peaks (no baseline subtracted): a tiny model's peak minus an import-only process is
    # within the noise of two processes' RSS, so the sign of that difference is not something to assert.
    train = measure(1, "distributed_optimizer", False, 0, model=["dataset.num_workers=0"])
    assert list(train.peaks) == [0] and len(train.states) == 1
    assert 0 < train.states[0] < train.peaks[0]  # a tiny model's state is far below the process's peak
    assert import_baseline() > 0
    line = case_line(1, "distributed_optimizer", train, train)
    assert re.fullmatch(r"DP=1 distributed_optimizer: train peak \d+\.\d\dx state, save adds x1\.00", line), line


def test_lines_from_known_numbers():
    train = Peaks({0: 300, 1: 400}, [100, 200])
    with_save = Peaks({0: 500, 1: 460}, [100, 200])
    assert case_line(2, "fsdp", train, with_save) == "DP=2 fsdp: train peak 2.00x state, save adds x1.25"
    ratio = fsdp_ratio_line({2: train, 4: Peaks({0: 240}, [50])})
    assert ratio == "fsdp per-rank train peak DP=4 / DP=2: 0.60"


def test_peaks_subtract_the_import_baseline_on_cpu_only():
    records = [{"rank": 0, "peak_rss": 1000, "cuda_peak": None}, {"rank": 1, "peak_rss": 900, "cuda_peak": 77}]
    assert peaks_of(records, 100) == {0: 900, 1: 77}


def test_state_line_is_required():
    assert parse_states(f"12:00:00 dfm.train: {STATE_LOG_KEY} [10, 20]\n") == [10, 20]
    with pytest.raises(ValueError, match="state bytes per rank"):
        parse_states("no such line")
