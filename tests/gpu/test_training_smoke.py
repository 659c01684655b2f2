"""A few bf16 training steps through the real entry point (pretrain_dit_model.py --mock) on the device,
one run per attention backend, compiled, and with both Wan 2.2 experts: the run exits 0, every loss
is finite, metrics.jsonl reports TFLOP/s and MFU.

Not here: Megatron-FSDP. dfm refuses it at DP x CP = 1 (megatron-core 0.16.1 doubles the gradients
of a one-rank group; dfm/parallel/rules.py), and two NCCL ranks cannot share one GPU: it needs a
two-GPU machine (tests/parallel runs it at DP=2 over gloo).

What each backend computes is proven elsewhere (packed == per-sample, parity); this proves the trainer
runs them on the device: kernels launch, nothing reads a device value back where it cannot, the
compiled graphs and FSDP's NCCL collectives work.
"""

from __future__ import annotations

import math

import pytest

from tests.gpu._device import GPU, cuda_only, subprocess_env
from tests.training.entry import TINY, read_metrics, run_entry
from tests.wan.test_wan22_experts import BOUNDARY, TINY_TEXT, WAN_TINY

pytestmark = GPU

ITERS = 3
WAN_BOTH = ["model.wan_expert=both", f"model.wan_boundary_ratio={BOUNDARY}", *TINY_TEXT]
QK = "model.qk_layernorm=true"  # dit_tiny (cross-attention DiT, RoPE) with LeanSelfAttention's fused q/k norm + RoPE
# name -> (config file, overrides)
RUNS = {
    "varlen": pytest.param(TINY, [QK, "model.attention_backend=varlen"], marks=cuda_only),
    "flex": pytest.param(TINY, [QK, "model.attention_backend=flex"], marks=cuda_only),  # no CPU backward
    "sdpa": (TINY, [QK, "model.attention_backend=sdpa"]),
    "compiled": (TINY, [QK, "model.compile=true"]),
    "wan22_both_experts": (WAN_TINY, WAN_BOTH),
}


@pytest.mark.parametrize(("config", "overrides"), list(RUNS.values()), ids=list(RUNS))
def test_a_few_bf16_steps_through_the_entry_point(tmp_path, config, overrides):
    run = [f"train.train_iters={ITERS}", "mixed_precision.precision=bf16", f"logger.log_dir={tmp_path}"]
    result = run_entry(1, [*run, *overrides], env=subprocess_env(), config=config, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    records = read_metrics(tmp_path)
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1))
    assert all(math.isfinite(r["loss"]) for r in records)
    assert all(r["tflops_per_gpu"] > 0 for r in records)
    assert all("mfu" in r for r in records)  # null where the device's peak is unknown (CPUs)


def test_async_saves_every_step_on_the_device(tmp_path):
    """The async save's writer fork and the wait's poll (its all-reduce on the rank's GPU under NCCL,
    dfm/checkpoint/async_wait.py): every step saved, the last one sealed and `latest`."""
    root = tmp_path / "ckpt"
    run = [f"train.train_iters={ITERS}", "mixed_precision.precision=bf16", f"logger.log_dir={tmp_path}", QK]
    run += [f"checkpoint.save={root}", "checkpoint.save_interval=1", "checkpoint.async_save=true"]
    result = run_entry(1, run, env=subprocess_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (root / "latest").read_text().strip() == str(ITERS)
    assert all((root / f"iter_{i:07d}" / "manifest.json").is_file() for i in range(1, ITERS + 1))
