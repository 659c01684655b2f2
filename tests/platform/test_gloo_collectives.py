"""The distributed optimizer's gloo collectives done in place (dfm/platform/compat/gloo_reduce.py):
the same bits as gloo's reduce-scatter / all-gather, without their copy of the bucket."""

import json
from pathlib import Path

import pytest

from tests.torchrun_worker import run_worker

WORKER = Path(__file__).with_name("_gloo_collectives_worker.py")


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("gloo_collectives")
    run_worker(
        WORKER, 3, out, timeout=240, shared_imports=False
    )  # 3 ranks: a sum of three is order-dependent, unlike two
    return [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]


@pytest.mark.slow
def test_in_place_collectives_give_gloos_bits(records):
    assert len(records) == 3
    for record in records:
        assert all(record["same_reduced"]), record
        assert all(record["same_gathered"]), record


@pytest.mark.slow
def test_in_place_reduce_scatter_adds_no_bucket_copy(records):
    for record in records:
        assert record["peaks"]["gloo"] >= 0.9 * record["bucket"], record  # what the patch removes
        assert record["peaks"]["in_place"] <= 0.1 * record["bucket"], record
