"""The training loop: megatron-core schedule, DDP, optimizer; metrics per log interval."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from dfm.config.container import ConfigContainer
from dfm.config.loader import format_config, save_config_yaml
from dfm.diffusion.pipeline import build_pipeline
from dfm.models.dit.flops import dit_training_flops
from dfm.platform.distributed import destroy_distributed, initialize_distributed
from dfm.training.forward_step import DiffusionForwardStep
from dfm.training.metrics_log import MetricsLog
from dfm.training.setup import build_mock_loader, build_model, build_optimizer, num_microbatches
from dfm.training.throughput import device_peak_flops, mfu

logger = logging.getLogger("dfm.train")


class RecordingIterator:
    """Wraps the loader to remember the per-sample lengths of each pack (for FLOPs / tokens)."""

    def __init__(self, loader):
        self.loader = loader
        self.packs: list[tuple[list[int], list[int]]] = []

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.loader)
        self.packs.append(
            (
                (batch.cu_seqlens_q[1:] - batch.cu_seqlens_q[:-1]).tolist(),
                (batch.cu_seqlens_kv[1:] - batch.cu_seqlens_kv[:-1]).tolist(),
            )
        )
        return batch

    def take(self) -> list[tuple[list[int], list[int]]]:
        packs, self.packs = self.packs, []
        return packs


def finalize_defaults(cfg: ConfigContainer) -> None:
    """Fill settings that depend on the layout (known only once process groups exist)."""
    dp = parallel_state.get_data_parallel_world_size()
    if cfg.train.global_batch_size is None:
        cfg.train.global_batch_size = cfg.train.micro_batch_size * dp


def reduce_loss_and_tokens(losses_reduced: list[dict], device: torch.device) -> tuple[float, float]:
    """Mean loss over micro-batches and DP ranks, real tokens summed; valid on every rank."""
    stats = torch.zeros(3, device=device)  # loss sum, micro-batch count, tokens
    is_reporting = (
        parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        and parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_context_parallel_rank() == 0
    )
    if is_reporting:
        for item in losses_reduced:
            loss, tokens = item["loss_and_tokens"]
            stats += torch.stack([loss, torch.ones_like(loss), tokens])
    torch.distributed.all_reduce(stats)
    return (stats[0] / stats[1].clamp(min=1)).item(), stats[2].item()


def train_step(forward_step, data_iter, model, optimizer, scheduler, n_micro: int):
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    forward_backward = get_forward_backward_func()
    losses = forward_backward(
        forward_step_func=forward_step,
        data_iterator=[data_iter] * len(model) if len(model) > 1 else data_iter,
        model=model if len(model) > 1 else model[0],
        num_microbatches=n_micro,
        seq_length=1,  # unused: variable_seq_lengths makes stages exchange shapes
        micro_batch_size=1,
        forward_only=False,
    )
    update_ok, grad_norm, _ = optimizer.step()
    if update_ok:
        scheduler.step(increment=1)
    return losses, update_ok, grad_norm


def pretrain(cfg: ConfigContainer, mock: bool) -> None:
    m = cfg.model
    device = initialize_distributed(
        m.tensor_model_parallel_size,
        m.pipeline_model_parallel_size,
        m.virtual_pipeline_model_parallel_size,
        m.context_parallel_size,
        m.expert_model_parallel_size,
        seed=cfg.rng.seed,
    )
    try:
        run(cfg, mock, device)
    finally:
        destroy_distributed()


def run(cfg: ConfigContainer, mock: bool, device: torch.device) -> None:
    rank = torch.distributed.get_rank()
    finalize_defaults(cfg)
    if rank == 0:
        logger.info("resolved config:\n%s", format_config(cfg))
        Path(cfg.logger.log_dir).mkdir(parents=True, exist_ok=True)
        save_config_yaml(cfg, Path(cfg.logger.log_dir) / "config.yaml")
    if not mock:
        raise NotImplementedError("energon data loading in the trainer is not wired yet; pass --mock")

    model, tconfig = build_model(cfg, device)
    optimizer, scheduler = build_optimizer(cfg, model, tconfig)
    pipeline = build_pipeline(cfg.model.pipeline)
    forward_step = DiffusionForwardStep(pipeline, cfg.rng.seed, cfg.dataset.cfg_dropout_prob, device)
    data_iter = RecordingIterator(build_mock_loader(cfg))
    n_micro = num_microbatches(cfg)
    world = torch.distributed.get_world_size()
    peak = device_peak_flops(device)
    metrics = MetricsLog(cfg.logger.log_dir, enabled=rank == 0, tensorboard_dir=cfg.logger.tensorboard_dir)
    skipped, window_start, window_iters, window_packs = 0, time.perf_counter(), 0, []
    for iteration in range(1, cfg.train.train_iters + 1):
        forward_step.iteration = iteration
        for chunk in model:
            chunk.train()
        losses, update_ok, grad_norm = train_step(forward_step, data_iter, model, optimizer, scheduler, n_micro)
        skipped += int(not update_ok)
        window_iters += 1
        window_packs += data_iter.take()
        if iteration % cfg.logger.log_interval and iteration != cfg.train.train_iters:
            continue
        loss, _ = reduce_loss_and_tokens(losses, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - window_start
        metrics.write(
            iteration_record(cfg, iteration, loss, optimizer, grad_norm, skipped, elapsed, window_iters, window_packs, world, peak)
        )
        window_start, window_iters, window_packs = time.perf_counter(), 0, []
    metrics.close()


def iteration_record(cfg, iteration, loss, optimizer, grad_norm, skipped, elapsed, iters, packs, world, peak) -> dict:
    """One metrics.jsonl line. Packs were seen by this rank; scale to the whole run's work per GPU."""
    dp = parallel_state.get_data_parallel_world_size()
    video_lens = [n for q, _ in packs for n in q]
    text_lens = [n for _, kv in packs for n in kv]
    # Every model-parallel rank of a replica sees the same packs; the replica's work is split over them.
    tokens_per_gpu = sum(video_lens) * dp / world
    flops_per_gpu = dit_training_flops(cfg.model, video_lens, text_lens) * dp / world
    tflops = flops_per_gpu / elapsed / 1e12
    return {
        "iteration": iteration,
        "train_iters": cfg.train.train_iters,
        "loss": loss,
        "lr": optimizer.param_groups[0]["lr"],
        "grad_norm": float(grad_norm) if grad_norm is not None and math.isfinite(float(grad_norm)) else None,
        "skipped_iterations": skipped,
        "step_time_s": elapsed / iters,
        "tokens_per_sec_per_gpu": tokens_per_gpu / elapsed,
        "tflops_per_gpu": tflops,
        "mfu": mfu(tflops, peak),
        "global_batch_size": cfg.train.global_batch_size,
    }
