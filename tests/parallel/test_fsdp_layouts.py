"""Megatron-FSDP (parameters, gradients and optimizer state sharded over data parallel) through the
real entry point, for DiT, ST-DiT, MovieGen, FLUX and Wan at DP=2 alone and with TP=2+SP and CP=2, and
MovieGen with EP=2: the same losses, gradient norms and updated weights as one process
(tests/parallel/equivalence.py).
The full weights are gathered from the FSDP row shards (dfm.parallel.fsdp_shards)."""

from __future__ import annotations

import pytest

from tests.parallel.equivalence import (
    CP2,
    DP_DATA,
    EP2,
    FLUX_TINY,
    FSDP,
    SP,
    TP2,
    assert_same_metrics,
    assert_same_validation,
    assert_same_weights,
    selected_params,
)

DP4_DATA = ["dataset.mock_samples_per_pack=2", "train.global_batch_size=4"]  # one pack per rank at DP=4
# (family, processes, layout, the one-process reference's data): DP = 2 in every case but MovieGen's
# EP=2, which runs at DP=4 so that every expert's gradients are reduced over 2 ranks (rules.py refuses
# EP = DP x CP under FSDP: megatron-core 0.16.1 doubles the gradients of one-rank groups).
CASES = [
    *(
        (family, nproc, [*FSDP, *extra, *DP_DATA], DP_DATA)
        for family in ("dit_tiny", "stdit_tiny", "moviegen_tiny")
        for nproc, extra in ((2, []), (4, [TP2, SP]), (4, [CP2]))
    ),
    ("moviegen_tiny", 4, [*FSDP, EP2, *DP4_DATA], DP4_DATA),
    # FLUX's strided single-block shards under FSDP. Wan: its last-registered module (time_proj) gets
    # its gradient late in the backward, which doubled its timestep path's gradients before
    # dfm.platform.compat.fsdp.forward_through_root_hooks.
    *(
        (family, nproc, [*FSDP, *extra, *DP_DATA], DP_DATA)
        for family in (FLUX_TINY, "wan_tiny")
        for nproc, extra in ((2, []), (4, [TP2, SP]), (4, [CP2]))
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("config,nproc,layout,reference", CASES, ids=lambda v: v if isinstance(v, str) else None)
def test_fsdp_layout_matches_single_process(request, layout_runs, config, nproc, layout, reference):
    cases = selected_params(request)  # run several per launch (equivalence.LayoutRuns)
    expected = layout_runs.get(config, 1, reference, [(c["config"], 1, tuple(c["reference"])) for c in cases])
    actual = layout_runs.get(config, nproc, layout, [(c["config"], c["nproc"], tuple(c["layout"])) for c in cases])
    assert_same_metrics(expected.metrics, actual.metrics)
    assert_same_weights(expected.weights, actual.weights)
    assert_same_validation(expected, actual)
