"""Same data on the ranks of one model replica (same DP rank), different data across DP ranks."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from dfm.data.energon.data_module import build_train_loader
from dfm.data.energon.task_encoder import sample_metadata
from dfm.data.mock import MockDataSettings, MockPackedLoader, MockPacking
from tests.data.synthetic_data import small_settings

NUM_PACKS = 6


def energon_pack_keys(path: str, dp_rank: int, dp_size: int, slot: int, results) -> None:
    """Runs in its own process, like one trainer rank (e.g. a TP rank of replica ``dp_rank``)."""
    loader = build_train_loader(small_settings(path, num_workers=1), dp_rank, dp_size)
    results.put((slot, [tuple(m["key"] for m in sample_metadata(next(loader))) for _ in range(NUM_PACKS)]))


@pytest.fixture(scope="module")
def rank_keys(synthetic_dataset):
    """Four separate processes: (dp 0, tp 0), (dp 0, tp 1), (dp 1, tp 0), (dp 1, tp 1) of a dp=2 run."""
    layout = [(0, 2), (0, 2), (1, 2), (1, 2)]
    # Fresh processes forked from one server that imported the loader once (not four imports of torch).
    context = mp.get_context("forkserver")
    context.set_forkserver_preload([__name__, "dfm.data.energon.data_module"])
    results = context.Queue()
    # Not a Pool: its daemonic workers could not start energon's own worker processes.
    processes = [
        context.Process(target=energon_pack_keys, args=(str(synthetic_dataset), r, n, slot, results))
        for slot, (r, n) in enumerate(layout)
    ]
    for process in processes:
        process.start()
    collected = dict(results.get(timeout=240) for _ in processes)
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    return [collected[slot] for slot in range(len(layout))]


def test_ranks_of_one_replica_see_identical_packs(rank_keys):
    assert rank_keys[0] == rank_keys[1]
    assert rank_keys[2] == rank_keys[3]


def test_data_parallel_ranks_see_different_samples(rank_keys):
    keys_dp0 = {k for pack in rank_keys[0] for k in pack}
    keys_dp1 = {k for pack in rank_keys[2] for k in pack}
    assert keys_dp0 and keys_dp1
    assert not keys_dp0 & keys_dp1


def mock_loader(dp_rank: int, dp_size: int, samples_per_pack=None) -> MockPackedLoader:
    mock = MockDataSettings(seed=11, in_channels=4, text_embed_dim=8)
    packing = MockPacking(seq_length=1024, segment_multiple=2, total_multiple=4, samples_per_pack=samples_per_pack)
    return MockPackedLoader(mock, dp_rank, dp_size, packing)


def test_mock_loader_same_dp_rank_same_packs_and_disjoint_across_dp():
    indices = {r: next(mock_loader(r, 2)).sample_index.tolist() for r in (0, 1)}
    a, b = mock_loader(0, 2), mock_loader(0, 2)
    for _ in range(5):
        pa, pb = next(a), next(b)
        assert pa.sample_index.tolist() == pb.sample_index.tolist()
        assert (pa.latents == pb.latents).all()
    assert not set(indices[0]) & set(indices[1])


def test_mock_index_mapping_is_documented_behaviour():
    # Rank r of n trains on global packs r, r + n, ...; with c samples per pack, global pack p is c*p .. c*p + c - 1.
    loader = mock_loader(1, 4, samples_per_pack=2)
    assert [next(loader).sample_index.tolist() for _ in range(3)] == [[2, 3], [10, 11], [18, 19]]


def test_mock_packs_are_the_same_whatever_the_dp_size():
    # The global packs of one dp=1 stream, dealt round-robin to the dp=3 ranks.
    one_rank = mock_loader(0, 1)
    global_packs = [next(one_rank).sample_index.tolist() for _ in range(9)]
    for rank in range(3):
        loader = mock_loader(rank, 3)
        assert [next(loader).sample_index.tolist() for _ in range(3)] == global_packs[rank::3]


def sample_tokens(batch, position: int):
    start = int(batch.cu_seqlens_q_padded[position])
    length = int(batch.cu_seqlens_q[position + 1] - batch.cu_seqlens_q[position])
    return batch.latents[start : start + length]


def test_a_sample_is_the_same_whatever_dp_layout_reaches_it():
    # Global index 3 is the 2nd sample of rank 1 when dp=2, and the 4th of rank 0 when dp=1.
    two_ranks = next(mock_loader(1, 2, samples_per_pack=2))
    one_rank = next(mock_loader(0, 1, samples_per_pack=4))
    assert two_ranks.sample_index.tolist() == [2, 3] and one_rank.sample_index.tolist() == [0, 1, 2, 3]
    assert torch.equal(sample_tokens(two_ranks, 1), sample_tokens(one_rank, 3))
