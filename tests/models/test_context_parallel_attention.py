"""Context-parallel attention (CP=2, two gloo processes) equals the single-process packed
attention on the same pack: outputs and input gradients, float64, samples of different lengths
with padded segments. Self-attention (K/V all-gathered), cross-attention (text not split) on
sdpa and flex (forward only: no CPU backward), and ST-DiT's spatial / temporal attention through
the all-to-all re-sharding. Tolerance 1e-10 (float64; only the order of sums differs)."""

from pathlib import Path

import pytest
import torch

from dfm.parallel.sequence_split import load_balanced_positions
from tests.torchrun_worker import run_worker

WORKER = Path(__file__).with_name("_cp_attention_worker.py")
TOLERANCE = 1e-10


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("cp_attention")
    run_worker(WORKER, 2, out, timeout=300)
    return [torch.load(out / f"rank{rank}.pt") for rank in range(2)]


EXPECTED = [
    *(f"{kind}/sdpa/{what}" for kind in ("self", "cross") for what in ("out", "dq", "dk", "dv")),
    "self/flex/out",
    "cross/flex/out",
    *(f"ulysses_{kind}/{what}" for kind in ("spatial", "temporal") for what in ("out", "dq", "dk", "dv")),
]


@pytest.mark.slow
@pytest.mark.parametrize("quantity", EXPECTED)
def test_cp_attention_matches_single_process(cp_results, quantity):
    for rank, results in enumerate(cp_results):
        assert results[quantity] < TOLERANCE, (rank, quantity, results[quantity])


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_load_balanced_split_covers_each_token_once(cp):
    """Rank r holds chunks r and 2*cp-1-r of every segment; all ranks together hold every token once."""
    segments = [4 * cp, 2 * cp, 6 * cp]
    cu = torch.tensor([0, *torch.tensor(segments).cumsum(0).tolist()], dtype=torch.int32)
    per_rank = [load_balanced_positions(cu, cp, rank) for rank in range(cp)]
    assert torch.equal(torch.sort(torch.cat(per_rank)).values, torch.arange(sum(segments)))
    chunk = segments[0] // (2 * cp)
    first_segment = per_rank[0][: 2 * chunk]
    assert first_segment.tolist() == [*range(chunk), *range((2 * cp - 1) * chunk, 2 * cp * chunk)]
    with pytest.raises(ValueError, match=f"cannot be split into 2\\*cp={2 * cp} chunks"):
        load_balanced_positions(torch.tensor([0, 2 * cp + 1], dtype=torch.int32), cp, 0)
