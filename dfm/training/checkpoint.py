"""Checkpoints with megatron-core dist_checkpointing: model, optimizer, schedule, RNG, data position.

Layout: ``<save>/iter_0000010/`` (one dist_checkpointing directory) and ``<save>/latest``
(a text file naming the newest *complete* iteration). ``latest`` is rewritten atomically by
rank 0 only after every rank finished writing, so a crash during a save leaves the previous
checkpoint loadable. Model tensors carry global names (``layers.<global index>``), so a
checkpoint loads into any TP / PP / DP layout (dist_checkpointing reshards).
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.transformer.utils import sharded_state_dict_default

from dfm.parallel.layout import layout_of
from dfm.platform.megatron_compat import ensure_adam_state, patch_distrib_optimizer_step_copy, unshare_adam_steps
from dfm.training.progress import StageProgress

logger = logging.getLogger("dfm.checkpoint")

LATEST = "latest"
LOAD_STAGES = ["plan", "read tensors", "model + EMA", "optimizer + schedule", "RNG + data position"]


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def resolve_load_dir(path: str | Path) -> Path | None:
    """A checkpoint directory, or the one a root's ``latest`` names; None if the root has none yet."""
    path = Path(path)
    if (path / LATEST).exists():
        return iteration_dir(path, int((path / LATEST).read_text().strip()))
    if (path / "metadata.json").exists():
        return path
    if path.exists() and any(path.glob("iter_*")):
        raise FileNotFoundError(f"checkpoint root {path} has iteration directories but no complete '{LATEST}' marker")
    return None


def _bump_replica_for_stage(sharded: dict[str, Any]) -> None:
    """Embedders replicated on every pipeline stage: only stage 0 holds the main replica."""
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    for value in sharded.values():
        if isinstance(value, ShardedTensor):
            replica = value.replica_id if isinstance(value.replica_id, tuple) else (value.replica_id,)
            value.replica_id = (pp_rank, *replica)


def model_sharded_state_dict(chunk) -> dict[str, Any]:
    """Sharded state dict of one (unwrapped) model chunk: local dict keys, global tensor keys."""
    state: dict[str, Any] = {}
    for name, child in chunk.named_children():
        if name == "layers":
            for local, layer in enumerate(child):
                global_prefix = f"layers.{chunk.layer_offset + local}."
                for key, value in layer.sharded_state_dict(prefix=global_prefix).items():
                    state[f"layers.{local}." + key[len(global_prefix) :]] = value
            continue
        # tp_group given explicitly: megatron 0.16.1 otherwise marks every TP rank a main replica.
        part = sharded_state_dict_default(
            child, prefix=f"{name}.", tp_group=parallel_state.get_tensor_model_parallel_group()
        )
        if any(getattr(p, "pipeline_parallel", False) for p in child.parameters()):
            _bump_replica_for_stage(part)
        state.update(part)
    return state


def _rank_object(key: str, data: Any, index: int, count: int, replica: tuple[int, ...] | int = 0) -> ShardedObject:
    return ShardedObject(key, data, (count,), (index,), replica_id=replica)


def rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def layout(model) -> dict[str, int]:
    """The fingerprint of the layout the (DDP-wrapped) model chunks were built for."""
    return layout_of(model[0].config).fingerprint()


def full_sharded_state_dict(
    model, optimizer, loader, is_loading: bool, with_rng: bool = True, with_data: bool = True, ema=None
) -> dict[str, Any]:
    """Everything sharded: model chunks (+ their EMA), optimizer, per-rank RNG and per-DP-rank data position."""
    state: dict[str, Any] = {}
    model_state: dict[str, Any] = {}
    chunk_states = [model_sharded_state_dict(chunk.module) for chunk in model]
    for index, chunk_state in enumerate(chunk_states):
        state[f"model{index}"] = chunk_state
        model_state.update({f"{index}.{k}": v for k, v in chunk_state.items()})
    if ema is not None:
        state.update(ema.sharded_state_dict(chunk_states))
    # Fully reshardable: optimizer state in model space, loadable into any TP/PP/DP layout. The
    # memory-efficient variant gathers over gloo groups on the host, the same on CPU and GPU.
    metadata = {
        "distrib_optim_sharding_type": "fully_reshardable",
        "distrib_optim_fully_reshardable_mem_efficient": True,
    }
    state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=metadata)
    if with_rng:  # per rank: only meaningful in the same layout
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        state["rng"] = _rank_object("rng_state", rng_state(), rank, world)
    if with_data:  # per data-parallel rank: needs the same DP size
        dp_rank, dp = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
        replica = (
            parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_context_parallel_rank(),
        )
        state["data"] = _rank_object("data_loader_state", loader.state_dict(), dp_rank, dp, replica)
    return state


def save_checkpoint(
    root: str,
    iteration: int,
    model,
    optimizer,
    scheduler,
    loader,
    config_dict: dict,
    keep_last: int | None,
    ema=None,
    async_queue=None,
) -> Path:
    """Write ``<root>/iter_N`` on all ranks, then mark it ``latest`` (rank 0) and prune old ones.

    With ``async_queue`` (megatron's ``AsyncCallsQueue``) the tensors are written by a forked
    process while training goes on; ``latest`` moves when the queue finalizes the save, which it
    does only once every rank has finished writing.
    """
    target = iteration_dir(root, iteration)
    rank = torch.distributed.get_rank()
    if rank == 0:
        if target.exists():  # a leftover of an interrupted save of this same iteration
            shutil.rmtree(target)
        target.mkdir(parents=True)
    torch.distributed.barrier()
    state = full_sharded_state_dict(model, optimizer, loader, is_loading=False, ema=ema)
    state.update(
        iteration=iteration,
        scheduler=scheduler.state_dict(),
        config=config_dict,
        layout=layout(model),
        has_ema=ema is not None,
    )
    if async_queue is None:
        dist_checkpointing.save(state, str(target))
        finalize_save(root, iteration, keep_last)
    else:
        request = dist_checkpointing.save(state, str(target), async_sharded_save=True)
        request.finalize_fns.append(partial(finalize_save, root, iteration, keep_last))
        async_queue.schedule_async_request(request)
    return target


def finalize_save(root: str, iteration: int, keep_last: int | None) -> None:
    """On all ranks, once every rank's files are written: mark ``latest``, prune, log."""
    rank = torch.distributed.get_rank()
    torch.distributed.barrier()
    if rank == 0:
        mark_latest(root, iteration)
        prune_checkpoints(root, keep_last)
    torch.distributed.barrier()
    if rank == 0:
        logger.info("saved checkpoint %s", iteration_dir(root, iteration))


def restore_ema(ema, loaded: dict | None, model, directory: Path) -> None:
    """EMA from the checkpoint; a run that turns EMA on mid-way starts it from the loaded weights."""
    if ema is None:
        return
    if loaded is not None:
        ema.load(loaded)
        return
    logger.warning("checkpoint %s has no EMA weights: EMA starts from the loaded model weights", directory)
    ema.reset(model)


def mark_latest(root: str | Path, iteration: int) -> None:
    tmp = Path(root) / f".{LATEST}.tmp"
    tmp.write_text(f"{iteration}\n")
    os.replace(tmp, Path(root) / LATEST)


def prune_checkpoints(root: str | Path, keep_last: int | None) -> None:
    if not keep_last:
        return
    for old in sorted(Path(root).glob("iter_*"))[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(path: str, model, optimizer, scheduler, loader, ema=None) -> int:
    """Restore everything from ``path`` (a checkpoint or a root with ``latest``); -> iteration (0 if none)."""
    directory = resolve_load_dir(path)
    if directory is None:
        logger.info("no checkpoint under %s: starting from scratch", path)
        return 0
    with StageProgress(f"load {directory.name}", LOAD_STAGES) as progress:
        common = dist_checkpointing.load_common_state_dict(str(directory))
        ensure_adam_state(optimizer)
        patch_distrib_optimizer_step_copy()
        same_layout = common.get("layout") == layout(model)
        same_dp = common.get("layout", {}).get("dp") == layout(model)["dp"]
        ema_saved = ema if common.get("has_ema") else None
        state = full_sharded_state_dict(
            model, optimizer, loader, is_loading=True, with_rng=same_layout, with_data=same_dp, ema=ema_saved
        )
        progress.advance()
        loaded = dist_checkpointing.load(state, str(directory))
        progress.advance()
        for index, chunk in enumerate(model):
            chunk.module.load_state_dict(loaded[f"model{index}"], strict=True)
        restore_ema(ema, loaded if ema_saved is not None else None, model, directory)
        progress.advance()
        optimizer.load_state_dict(loaded["optimizer"])
        unshare_adam_steps(optimizer)
        scheduler.load_state_dict(loaded["scheduler"])
        progress.advance()
        if same_layout:
            set_rng_state(loaded["rng"])
        if "data" in loaded:
            loader.load_state_dict(loaded["data"])
        else:
            logger.warning(
                "checkpoint %s was written with data-parallel size %s, now %s: the data position is not restored",
                directory,
                common.get("layout", {}).get("dp"),
                layout(model)["dp"],
            )
        progress.advance()
    logger.info("loaded checkpoint %s (iteration %d)", directory, loaded["iteration"])
    return int(loaded["iteration"])
