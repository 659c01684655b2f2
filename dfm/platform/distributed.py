"""Process group and megatron-core parallel_state setup, the same on CUDA (nccl) and CPU (gloo)."""

import os
from datetime import timedelta

import torch

from dfm.platform import compat
from dfm.platform.device import compute_device


def initialize_distributed(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    seed: int = 1234,
    timeout_minutes: int = 30,
) -> torch.device:
    """Start torch.distributed and megatron's model-parallel groups, seed all RNGs.

    Reads the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT);
    without torchrun it runs as a single process. Returns the device to compute on.
    """
    compat.install()
    rank, world_size = _rank_and_world_size()
    validate_parallel_layout(
        world_size,
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        context_parallel_size,
        expert_model_parallel_size,
        virtual_pipeline_model_parallel_size,
    )
    device = compute_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
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
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        distributed_timeout_minutes=timeout_minutes,
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


def validate_parallel_layout(
    world_size: int,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
) -> int:
    """Check that the parallel sizes tile the world; return the data-parallel size."""
    sizes = {
        "tensor_model_parallel_size": tensor_model_parallel_size,
        "pipeline_model_parallel_size": pipeline_model_parallel_size,
        "context_parallel_size": context_parallel_size,
        "expert_model_parallel_size": expert_model_parallel_size,
    }
    for name, size in sizes.items():
        if size < 1:
            raise ValueError(f"{name} must be >= 1, got {size}")
    model_parallel = tensor_model_parallel_size * pipeline_model_parallel_size
    model_parallel *= context_parallel_size
    if world_size % model_parallel:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor ({tensor_model_parallel_size}) "
            f"x pipeline ({pipeline_model_parallel_size}) x context ({context_parallel_size}) "
            f"parallel sizes = {model_parallel}"
        )
    data_parallel = world_size // model_parallel
    # Experts are sharded over the data-parallel x context-parallel ranks of each stage.
    if (data_parallel * context_parallel_size) % expert_model_parallel_size:
        raise ValueError(
            f"expert_model_parallel_size {expert_model_parallel_size} must divide data-parallel "
            f"size {data_parallel} x context-parallel size {context_parallel_size} "
            f"(world size {world_size}, tensor {tensor_model_parallel_size}, "
            f"pipeline {pipeline_model_parallel_size})"
        )
    if virtual_pipeline_model_parallel_size is not None and pipeline_model_parallel_size < 2:
        raise ValueError(
            f"virtual_pipeline_model_parallel_size={virtual_pipeline_model_parallel_size} needs "
            f"pipeline_model_parallel_size >= 2, got {pipeline_model_parallel_size}"
        )
    return data_parallel


def destroy_distributed() -> None:
    """Tear down megatron's parallel groups and the default process group."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _rank_and_world_size() -> tuple:
    """Rank and world size from torchrun; defaults make a lone process a world of one."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


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
