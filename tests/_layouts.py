"""What the per-family layout tests share: one 2-process launch of a family's ``_layouts_worker.py``
(megatron's parallel state re-initialised per layout, each rank writing {name: max abs diff} to
OUT/rank<R>.json) and the checks on those per-rank results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.torchrun_worker import run_worker

LAYOUTS = ("tp2_sp", "cp2", "pp2")
GRADIENT_LAYOUTS = ("tp2_sp", "cp2")  # the layouts whose gradients the workers compare
# The ranks that hold the output: TP and CP ranks all do (gathered), PP only the last stage.
EXPECTED = {0: {"tp2_sp", "cp2"}, 1: {"tp2_sp", "cp2", "pp2"}}


def layout_results(worker: Path, out: Path, args: tuple = ()) -> dict[int, dict[str, float | None]]:
    """Run ``worker *args out`` on 2 ranks; rank -> its results (None: no output on that rank)."""
    run_worker(worker, 2, out, timeout=300, args=args)
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)}


def assert_outputs_match(results: dict[int, dict[str, float]], layout: str, tolerance: float, case: str = "") -> None:
    """Every rank that holds ``layout``'s output is within ``tolerance``; ``case``: the results'
    prefix of another model the worker ran (``i2v/``)."""
    for rank, names in EXPECTED.items():
        if layout in names:
            key = case + layout
            assert results[rank][key] <= tolerance, (rank, key, results[rank][key])


def assert_gradients_match(results: dict[int, dict[str, float]], layout: str, tolerance: float, case: str = "") -> None:
    """Every rank's gradient difference under ``layout`` (of ``case``) is within ``tolerance``. The
    gradients come through megatron's schedule and the trainer's finalize_model_grads (tests/_layouts_rank.py):
    with that finalize replaced by a no-op, Wan's and HunyuanVideo's tp2_sp and cp2 cases fail (checked
    2026-11-28)."""
    for rank in range(2):
        key = f"{case}{layout}/grad"
        assert results[rank][key] <= tolerance, (rank, key, results[rank][key])


class LayoutTests:
    """A family's layout tests against diffusers: a ``Test...`` subclass names its ``WORKER`` (writing
    ``{layout: output diff, layout/grad: gradient diff}`` per rank), ``TOLERANCE`` and ``GRAD_TOLERANCE``."""

    WORKER: Path
    TOLERANCE: float
    GRAD_TOLERANCE: float

    @pytest.fixture(scope="class")
    def results(self, tmp_path_factory) -> dict[int, dict[str, float | None]]:
        return layout_results(self.WORKER, tmp_path_factory.mktemp(self.WORKER.parent.name + "_layouts"))

    @pytest.mark.parametrize("layout", LAYOUTS)
    def test_layout_matches_diffusers(self, results, layout):
        assert_outputs_match(results, layout, self.TOLERANCE)

    @pytest.mark.parametrize("layout", GRADIENT_LAYOUTS)
    def test_layout_gradients_match_diffusers(self, results, layout):
        assert_gradients_match(results, layout, self.GRAD_TOLERANCE)
