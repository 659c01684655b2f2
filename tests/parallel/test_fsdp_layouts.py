"""Megatron-FSDP (parameters, gradients and optimizer state sharded over data parallel) through the
real entry point: the same losses, gradient norms and updated weights as one process (tolerances:
test_layout_equivalence.py), for ST-DiT at DP=2, MovieGen at DP=4 x EP=2, DiT at DP=2 x TP=2+SP and
DP=2 x CP=2. The full weights are gathered from the FSDP row shards (dfm.models.common.fsdp_shards).
DiT at plain DP=2 trains in tests/parallel/test_fsdp_resume.py; by hand it matches to 0.0."""

from __future__ import annotations

import pytest

from tests.parallel.test_layout_equivalence import (  # noqa: F401 (reference_runs is a fixture)
    DP_DATA,
    SP,
    TP2,
    assert_same_metrics,
    assert_same_weights,
    reference_runs,
    train,
)

FSDP = ["ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params"]
CP2 = "model.context_parallel_size=2"
EP2 = "model.expert_model_parallel_size=2"
DP4_DATA = ["dataset.mock_samples_per_pack=2", "train.global_batch_size=4"]  # one pack per rank at DP=4
# (family, processes, layout, the one-process reference's data): DP >= 2 in every case. MovieGen
# runs EP=2 at DP=4 so that every expert's gradients are reduced over 2 ranks (rules.py refuses
# EP = DP x CP under FSDP: megatron-core 0.16.1 doubles the gradients of one-rank groups).
CASES = [
    ("stdit_tiny", 2, [*FSDP, *DP_DATA], DP_DATA),
    ("moviegen_tiny", 4, [*FSDP, EP2, *DP4_DATA], DP4_DATA),
    ("dit_tiny", 4, [*FSDP, TP2, SP, *DP_DATA], DP_DATA),
    ("dit_tiny", 4, [*FSDP, CP2, *DP_DATA], DP_DATA),
]


@pytest.mark.parametrize("config,nproc,layout,reference", CASES, ids=lambda v: v if isinstance(v, str) else None)
def test_fsdp_layout_matches_single_process(tmp_path, reference_runs, config, nproc, layout, reference):  # noqa: F811
    expected = reference_runs(config, reference)
    actual = train(tmp_path, config, nproc, layout)
    assert_same_metrics(expected.metrics, actual.metrics)
    assert_same_weights(expected.weights, actual.weights)
