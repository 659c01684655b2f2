"""Every model family, several parallel layouts, through the real entry point: the same losses,
gradient norms and updated weights as the single-process run from the same seed and data
(tests/parallel/equivalence.py: how runs are compared, and the tolerances)."""

from __future__ import annotations

import pytest

from tests.parallel.equivalence import (
    ACCUMULATE,
    CP2,
    DIST_OPT,
    DP_DATA,
    EP2,
    FLUX_TINY,
    FP8,
    HUNYUAN_TINY,
    PP2,
    SP,
    TP2,
    VPP,
    assert_same_metrics,
    assert_same_validation,
    assert_same_weights,
    selected_params,
    world_size,
)

# The DiT-7B preset's block: low-rank adaLN, a context narrower than the hidden size, RMSNorm, no biases.
NEMO_BLOCK = [
    "model.adaln_lora_dim=8",
    "model.cross_attention_dim=16",
    "model.normalization=rmsnorm",
    "model.add_bias_linear=false",
    "model.qk_layernorm=true",
]

CASES = [
    ("dit_tiny", [TP2, SP], []),
    ("dit_tiny", [PP2], []),
    ("dit_tiny", [DIST_OPT, *DP_DATA], DP_DATA),
    ("dit_tiny", [*ACCUMULATE], ACCUMULATE),
    ("dit_tiny", [TP2, SP, PP2], []),
    ("stdit_tiny", [TP2], []),
    ("stdit_tiny", [PP2], []),
    ("moviegen_tiny", [TP2, SP], []),
    ("moviegen_tiny", [PP2], []),
    ("moviegen_tiny", [EP2, DIST_OPT, *DP_DATA], DP_DATA),
    ("moviegen_tiny", [TP2, SP, PP2], []),
    ("dit_tiny", [CP2], []),
    ("stdit_tiny", [CP2], []),
    ("moviegen_tiny", [CP2], []),
    ("dit_tiny", [TP2, SP, CP2], []),
    ("stdit_tiny", [TP2, SP], []),
    ("stdit_tiny", [TP2, SP, CP2], []),
    # Every family gets every dimension and both named combinations (TP x CP, PP x TP).
    ("stdit_tiny", [DIST_OPT, *DP_DATA], DP_DATA),
    ("stdit_tiny", [TP2, SP, PP2], []),
    ("moviegen_tiny", [TP2, SP, CP2], []),
    ("dit_tiny", VPP, ["model.num_layers=4", *ACCUMULATE]),
    (FLUX_TINY, [TP2, SP], []),
    # Wan: q/k RMSNorm across the heads that TP splits (all-reduced sum of squares), its affine norm2 under SP.
    ("wan_tiny", [TP2, SP], []),
    ("dit_tiny", [*NEMO_BLOCK, TP2, SP], NEMO_BLOCK),
    # Once checked by hand, now here: FLUX's CP and PP in one run; PP x CP and EP x CP with MoE. Mutation
    # checked: every CP rank taking rank 0's share (ParallelLayout.sequence_split) fails all three.
    (FLUX_TINY, [PP2, CP2], []),
    ("moviegen_tiny", [PP2, CP2], []),
    ("moviegen_tiny", [EP2, CP2], []),
    # HunyuanVideo 1.5 (dual-stream blocks, token refiner, mock text-to-video / image-to-video packs): its
    # three dimensions on 2 processes, one launch.
    (HUNYUAN_TINY, [TP2, SP], []),
    (HUNYUAN_TINY, [CP2], []),
    (HUNYUAN_TINY, [PP2], []),
    # FP8 products: every amax taken over the ranks that split its tensor (TP's weight and feature shards,
    # SP and CP's tokens), so the quantized operands are one process's; DP ranks quantize their own
    # micro-batches, as one process accumulating the same micro-batches does.
    ("dit_tiny", [FP8, TP2, SP, CP2], [FP8]),
    ("dit_tiny", [FP8, *ACCUMULATE], [FP8, *ACCUMULATE]),
]


@pytest.mark.slow
@pytest.mark.parametrize("config,layout,reference_overrides", CASES, ids=lambda v: v if isinstance(v, str) else None)
def test_layout_matches_single_process(request, layout_runs, config, layout, reference_overrides):
    cases = selected_params(request)  # run several per launch (equivalence.LayoutRuns)
    references = [(c["config"], 1, tuple(c["reference_overrides"])) for c in cases]
    expected = layout_runs.get(config, 1, reference_overrides, references)
    layouts = [(c["config"], world_size(c["layout"]), tuple(c["layout"])) for c in cases]
    actual = layout_runs.get(config, world_size(layout), layout, layouts)
    assert_same_metrics(expected.metrics, actual.metrics)
    assert_same_weights(expected.weights, actual.weights)
    assert_same_validation(expected, actual)
