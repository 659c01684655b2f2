"""The CPU device layer: megatron-core's schedule, DDP, optimizer, TP/SP, DP, PP, MoE/EP and
dist_checkpointing on CPU/gloo reproduce the single-process results.

All megatron work runs in fresh processes (tests/platform/_workers.py): one single-process
launch computes the references, one two-process gloo launch the parallel layouts.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from dfm.parallel import ParallelLayout
from tests.zygote import checkout_env, python_args

WORKERS = Path(__file__).with_name("_workers.py")
LAUNCH_TIMEOUT_S = 300

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU device layer tests")


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(launch, out_dir, world_size):
    """Run `_workers.py launch` as `world_size` gloo ranks; return each rank's results."""
    port = str(_free_port())
    procs = []
    for rank in range(world_size):
        env = checkout_env(
            dict(
                os.environ,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                OMP_NUM_THREADS="1",
            )
        )
        log = open(out_dir / f"{launch}_rank{rank}.log", "w")
        procs.append(
            subprocess.Popen(
                [sys.executable, *python_args(), str(WORKERS), launch, str(out_dir)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    for rank, proc in enumerate(procs):
        try:
            proc.wait(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"{launch} launch timed out; see {out_dir}/{launch}_rank{rank}.log")
        if proc.returncode != 0:
            tail = (out_dir / f"{launch}_rank{rank}.log").read_text()[-4000:]
            pytest.fail(f"{launch} rank {rank} exited with {proc.returncode}:\n{tail}")
    return [torch.load(out_dir / f"{launch}_rank{rank}.pt", weights_only=False) for rank in range(world_size)]


def _scenario(results, key, scenario):
    error = results.get(f"error:{scenario}")
    if error:
        pytest.fail(f"{scenario} raised in the worker:\n{error}")
    return results[key]


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("device_layer")
    (single,) = _launch("single", out_dir, world_size=1)
    pair = _launch("pair", out_dir, world_size=2)
    return single, pair


@pytest.mark.slow
def test_schedule_ddp_adam_train_tiny_gpt_on_cpu(launches):
    single, _ = launches
    losses = _scenario(single, "gpt_losses", "scenario_train_gpt")
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses
    assert all(torch.isfinite(torch.tensor(single["gpt_grad_norms"])))


@pytest.mark.slow
def test_rng_tracker_fork_is_reproducible_and_separate(launches):
    single, _ = launches
    rng = _scenario(single, "rng", "scenario_rng_tracker")
    assert_close(rng["forked"], rng["forked_again"], rtol=0, atol=0)
    # Forking must not advance the default stream: it continues as if no fork happened.
    assert_close(rng["default"], rng["default_again"], rtol=0, atol=0)
    assert not torch.equal(rng["forked"], rng["default"])


@pytest.mark.slow
def test_tensor_parallel_block_matches_tp1(launches):
    single, pair = launches
    reference = _scenario(single, "block_tp1", "scenario_block_reference")
    for rank, results in enumerate(pair):
        for key in ("block_tp2", "block_tp2_sp"):
            got = _scenario(results, key, "scenario_block_tp2")
            assert_close(got["params"], reference["params"], msg=f"{key} rank {rank} params")
            assert_close(got["output"], reference["output"], msg=f"{key} rank {rank} output")
            assert_close(got["grads"], reference["grads"], msg=f"{key} rank {rank} grads")


@pytest.mark.slow
def test_distributed_optimizer_dp2_matches_dp1(launches):
    single, pair = launches
    reference = _scenario(single, "gpt_final_params", "scenario_train_gpt")
    for rank, results in enumerate(pair):
        got = _scenario(results, "dp2_final_params", "scenario_dp2_distributed_optimizer")
        # Four Adam steps amplify float-rounding differences of near-zero grads (sum order
        # differs between DP sizes) up to ~1e-5; lr is 1e-2, so 1e-4 is 1% of one step.
        assert_close(got, reference, atol=1e-4, rtol=1e-4, msg=f"rank {rank}")
        assert_close(results["dp2_grad_norms"], single["gpt_grad_norms"], rtol=1e-5, atol=0)


@pytest.mark.slow
def test_pipeline_parallel_pp2_matches_pp1(launches):
    single, pair = launches
    last_stage = pair[1]
    losses = _scenario(last_stage, "pp2_losses", "scenario_pp2")
    assert_close(losses, single["gpt_losses"], rtol=1e-5, atol=0)
    assert pair[0]["pp2_losses"] == [None] * len(losses)  # only the last stage has a loss
    for results in pair:
        assert_close(results["pp2_grad_norms"], single["gpt_grad_norms"], rtol=1e-5, atol=0)


@pytest.mark.slow
def test_dist_checkpointing_roundtrip_and_reshard(launches):
    _, pair = launches
    for rank, results in enumerate(pair):
        saved = _scenario(results, "ckpt_saved", "scenario_dist_checkpoint")
        assert_close(results["ckpt_loaded_tp2"], saved, rtol=0, atol=0, msg=f"rank {rank}")
        assert_close(results["ckpt_loaded_tp1"], saved, rtol=0, atol=0, msg=f"rank {rank}")


@pytest.mark.slow
def test_moe_expert_parallel_matches_single_process(launches):
    single, pair = launches
    reference = _scenario(single, "moe_ep1", "scenario_moe_reference")
    for rank, results in enumerate(pair):
        got = _scenario(results, "moe_ep2", "scenario_moe_ep2")
        assert_close(got["outputs"][rank], reference["outputs"][rank], msg=f"rank {rank}")
        assert_close(got["input_grads"][rank], reference["input_grads"][rank])


def test_layout_validation_names_the_sizes():
    assert ParallelLayout(world_size=8, tp=2, cp=2).dp == 2
    with pytest.raises(ValueError, match=r"tensor \(2\) x pipeline \(3\)"):
        ParallelLayout(world_size=8, tp=2, pp=3)
    with pytest.raises(ValueError, match="expert_model_parallel_size 4"):
        ParallelLayout(world_size=4, tp=2, ep=4)
    with pytest.raises(ValueError, match="virtual_pipeline"):
        ParallelLayout(world_size=2, vpp=2)
