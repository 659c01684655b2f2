"""Megatron-FSDP (parameters, gradients and optimizer state sharded over data parallel) through the
real entry point: the same losses, gradient norms and updated weights as one process, per family at
DP=2 and combined with TP=2+SP, CP=2 and (MovieGen) EP=2 (tolerances: test_layout_equivalence.py).
The full weights are gathered from the FSDP row shards (dfm.models.common.fsdp_shards)."""

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
# (family, processes, layout): DP=2 in every case, the model-parallel sizes on top.
CASES = [
    ("dit_tiny", 2, [*FSDP, *DP_DATA]),
    ("stdit_tiny", 2, [*FSDP, *DP_DATA]),
    ("moviegen_tiny", 2, [*FSDP, EP2, *DP_DATA]),
    ("dit_tiny", 4, [*FSDP, TP2, SP, *DP_DATA]),
    ("dit_tiny", 4, [*FSDP, CP2, *DP_DATA]),
]


@pytest.mark.parametrize("config,nproc,layout", CASES, ids=lambda v: v if isinstance(v, str) else None)
def test_fsdp_layout_matches_single_process(tmp_path, reference_runs, config, nproc, layout):  # noqa: F811
    expected = reference_runs(config, DP_DATA)
    actual = train(tmp_path, config, nproc, layout)
    assert_same_metrics(expected.metrics, actual.metrics)
    assert_same_weights(expected.weights, actual.weights)
