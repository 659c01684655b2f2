"""Process group and megatron-core parallel_state setup, the same on CUDA (nccl) and CPU (gloo)."""

import os
from datetime import timedelta

import torch

from dfm.parallel.layout import ParallelLayout, launched_world_size
from dfm.platform import compat
from dfm.platform.device import compute_device
from dfm.platform.host_memory import return_freed_memory_promptly


def initialize_distributed(
    layout: ParallelLayout | None = None, seed: int = 1234, timeout_minutes: int = 30
) -> torch.device:
    """Start torch.distributed and megatron's model-parallel groups for ``layout``, seed all RNGs.

    Reads the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT);
    without torchrun it runs as a single process. ``layout`` None: data parallel over every
    rank. Returns the device to compute on.
    """
    compat.install()
    rank, world_size = _rank_and_world_size()
    layout = layout or ParallelLayout(world_size=world_size)
    if layout.world_size != world_size:
        raise ValueError(f"the parallel layout is for {layout.world_size} ranks, but {world_size} were launched")
    device = compute_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        return_freed_memory_promptly()  # host tensors are the model's memory: no malloc cache on top
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(minutes=timeout_minutes),
            init_method=_init_method(),
        )
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        **layout.megatron_parallel_kwargs(), distributed_timeout_minutes=timeout_minutes
    )
    seed_everything(seed)
    return device


def seed_everything(seed: int) -> None:
    """Seed torch and megatron's tensor-parallel RNG tracker like megatron's training loop.

    Each pipeline stage gets its own offset (as in Megatron-LM), so stages do not share
    dropout masks; the tracker gives TP ranks distinct and DP replicas identical streams.
    Must run after parallel_state is initialized.
    """
    from megatron.core import parallel_state, tensor_parallel

    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    torch.manual_seed(stage_seed)
    # On CPU the compat layer maps the tracker's CUDA generators to the CPU generator.
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed, force_reset_rng=True)


def alone() -> bool:
    """The job is this one process: every collective is over a group of one."""
    return torch.distributed.get_world_size() == 1


def destroy_distributed() -> None:
    """Tear down megatron's parallel groups and the default process group."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _rank_and_world_size() -> tuple:
    """Rank and world size from torchrun; defaults make a lone process a world of one."""
    return int(os.environ.get("RANK", "0")), launched_world_size()


def _init_method() -> str:
    """torchrun's env:// rendezvous, or a private free port for a lone process.

    A lone process must not export MASTER_PORT: child processes (tests, launchers) would
    inherit it and collide with the store this process still holds.
    """
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        return "env://"
    return f"tcp://127.0.0.1:{_free_port()}"


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
