"""Validation at ``train.eval_interval``: loss on held-out packs at fixed noise levels (one per bin,
``train.eval_noise_bins``) and one generated sample per DP rank, at any layout (the pipeline stages
sample as one model: staged_model.py).

The generated latent goes to ``<checkpoint.save>/validation_generation/iter_<N>_dp<R>.pt``, undecoded;
``validation.prompts`` are decoded and written for people to look at (validation_media.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from dfm.config.container import ConfigContainer
from dfm.data.packed_batch import PackedBatch
from dfm.diffusion.pipeline import DiffusionPipeline, SamplingOptions
from dfm.inference.generation_batch import draw_noise, generation_batch
from dfm.inference.student import sample_as_trained
from dfm.training.losses import reduce_loss_and_tokens
from dfm.training.setup import schedule_model_and_data
from dfm.training.staged_model import sampling_model

logger = logging.getLogger("dfm.validation")


def losses_per_level(forward_step, packs: list, model: list, levels: list[float], device) -> list[float]:
    """Mean validation loss over ``packs`` (this rank's; averaged over DP ranks) at each fixed level:
    every sample at that level, the noise of iteration 0. Valid on every rank."""
    means = []
    try:
        for level in levels:
            forward_step.fixed_level = level
            losses = validation_loss(forward_step, iter(packs), model, len(packs))
            means.append(reduce_loss_and_tokens(losses, device)[0])
    finally:
        forward_step.fixed_level = None
    return means


def level_record(levels: list[float], means: list[float]) -> dict:
    """``val_loss`` (the mean over levels), ``val_loss_t<k>`` per level and the levels themselves."""
    return {
        "val_loss": sum(means) / len(means),
        **{f"val_loss_t{k}": mean for k, mean in enumerate(means)},
        "val_levels": levels,
    }


def validation_loss(forward_step, val_iter, model: list, num_packs: int) -> list[dict]:
    """Forward-only pass over ``num_packs`` validation packs (noise fixed: iteration 0)."""
    for chunk in model:
        chunk.eval()
    with torch.no_grad():
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            **schedule_model_and_data(model, val_iter),
            num_microbatches=num_packs,
            seq_length=1,
            micro_batch_size=1,
            forward_only=True,
        )


def first_sample_text(batch: PackedBatch) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Text [L, D] and latent shape (C, T, H, W) of a pack's first sample."""
    start, length = int(batch.cu_seqlens_kv_padded[0]), int(batch.cu_seqlens_kv[1] - batch.cu_seqlens_kv[0])
    return batch.context[start : start + length], tuple(int(v) for v in batch.latent_shape[0])


def writes_samples() -> bool:
    """Whether this rank writes its data-parallel replica's sample: every rank of the replica's tensor,
    context and pipeline groups holds the same one (``sampling_model``)."""
    return (
        parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_context_parallel_rank() == 0
        and parallel_state.is_pipeline_first_stage(ignore_virtual=True)
    )


def generate_validation_sample(
    cfg: ConfigContainer,
    model: list,
    pipeline: DiffusionPipeline,
    batch: PackedBatch,
    iteration: int,
    device,
    multiples: tuple[int, int] = (1, 1),
) -> Path | None:
    """Sample one latent from the first validation sample's text, at any layout (``multiples``: its
    padding); -> where it was saved (or None)."""
    if not cfg.checkpoint.save:
        return None
    dp_rank = parallel_state.get_data_parallel_rank()
    text, shape = first_sample_text(batch)
    seed = cfg.rng.seed + dp_rank
    gen_batch = generation_batch(draw_noise(shape, seed), text, cfg.model, multiples=multiples).to(device)
    options = SamplingOptions(steps=cfg.train.eval_sampling_steps)
    latent = sample_as_trained(sampling_model(model), pipeline, gen_batch, cfg, options, seed)
    if not writes_samples():
        return None
    path = Path(cfg.checkpoint.save) / "validation_generation" / f"iter_{iteration:07d}_dp{dp_rank}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"latent": latent.cpu(), "text": text.cpu(), "iteration": iteration}, path)
    return path
