"""A rank never holds more of the model than it owns while the model is built: a 12-layer DiT
(71 MB in fp32) built at TP=2 x DP=2 and under Megatron-FSDP at DP=4, 4 gloo processes, every CPU
tensor created during the build tracked (_build_memory_worker.py), initial values drawn in 64 KiB.

Measured, bytes above what the rank keeps after the build:
* TP=2: +32 KB over its 36 MB (before meta-device builds: +2.4 MB, the largest full weight drawn whole).
* FSDP DP=4: +22 to +43 KB over its 53 MB of shards (weights, main weights, gradients); nothing of
  the model exists before Megatron-FSDP shards it (before: the whole 71 MB model, peak +26 MB).
  In bf16 the same build's values are checked too (before, the host's 35 MB bf16 model was freed
  while the fp32 shards grew: no higher peak on CPU, but the whole model existed before sharding).
"""

from pathlib import Path

import pytest
import torch

from tests.torchrun_worker import run_worker

WORKER = Path(__file__).with_name("_build_memory_worker.py")
SLACK = 32 << 10  # small tensors of the build itself (row counts, generator state)


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("build_memory")
    run_worker(WORKER, 4, out, timeout=600)  # tensor bytes, not the process: shared imports are fine
    return [torch.load(out / f"rank{rank}.pt") for rank in range(4)]


@pytest.mark.slow
def test_tensor_parallel_build_holds_its_share_plus_one_chunk(builds):
    for rank, result in enumerate(builds):
        tp, chunk = result["tp"], result["chunk"]
        assert tp["kept"] == tp["share"], rank  # the build leaves nothing behind but the parameters
        assert tp["peak"] <= tp["share"] + chunk + SLACK, (rank, tp)
        assert tp["largest_full"] > chunk + SLACK  # drawing a full weight whole would not fit


@pytest.mark.slow
def test_fsdp_build_shards_before_anything_is_allocated(builds):
    for rank, result in enumerate(builds):
        fsdp, chunk = result["fsdp"], result["chunk"]
        assert fsdp["before_sharding"] == 0, rank
        # Megatron-FSDP's own transient while it shards: one unit's gathered weights (as in each
        # forward) and one module's parameters; then the rows are drawn within one chunk.
        transient = fsdp["largest_unit"] + fsdp["largest_module"] + chunk + SLACK
        assert fsdp["peak"] <= fsdp["kept"] + transient, (rank, fsdp)
        assert fsdp["model"] > transient + fsdp["largest_unit"]  # the whole model would not fit in it
        assert fsdp["largest_diff"] == 0.0, rank  # its rows are bit for bit the one-piece model's


@pytest.mark.slow
def test_bf16_fsdp_build_holds_the_bf16_model_values(builds):
    for rank, result in enumerate(builds):
        assert result["fsdp_bf16"]["before_sharding"] == 0, rank
        assert result["fsdp_bf16"]["largest_diff"] == 0.0, rank  # main weights: the bf16 values, in fp32
