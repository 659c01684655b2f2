"""dfm's Wan equals diffusers under TP=2 + SP, CP=2 and PP=2 (one launch of 2 gloo processes,
megatron's parallel state re-initialised per layout): the pack of three shapes of the
single-process parity test, two of them Wan 2.2 TI2V samples (per-token timesteps, first frame at 0), each sample against diffusers run alone, outputs <= 1e-5 max abs diff;
under TP=2 + SP and CP=2 also every parameter gradient (each rank's shard, after the reductions
megatron adds) within 1e-4 of diffusers' relative to its max."""

import json
from pathlib import Path

import pytest

from tests.torchrun_worker import run_worker

WORKER = Path(__file__).with_name("_layouts_worker.py")
TOLERANCE = 1e-5
GRAD_TOLERANCE = 1e-4  # relative; fp32 sums in another order (measured <= 3e-6)
# The ranks that hold the output: TP and CP ranks all do (gathered), PP only the last stage.
EXPECTED = {0: {"tp2_sp", "cp2"}, 1: {"tp2_sp", "cp2", "pp2"}}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[int, dict[str, float]]:
    out = tmp_path_factory.mktemp("wan_layouts")
    run_worker(WORKER, 2, out, timeout=300)
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)}


@pytest.mark.parametrize("layout", ["tp2_sp", "cp2", "pp2"])
def test_layout_matches_diffusers(results, layout):
    for rank, names in EXPECTED.items():
        if layout in names:
            assert results[rank][layout] <= TOLERANCE, (rank, layout, results[rank][layout])


@pytest.mark.parametrize("layout", ["tp2_sp", "cp2"])
def test_layout_gradients_match_diffusers(results, layout):
    for rank in range(2):
        assert results[rank][f"{layout}/grad"] <= GRAD_TOLERANCE, (rank, layout, results[rank][f"{layout}/grad"])
