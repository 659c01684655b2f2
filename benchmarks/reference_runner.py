"""Time the plain-PyTorch reference DiT on the same packs, with the same optimizer settings.

Textbook training: fp32 parameters, ``torch.autocast`` to bf16 when the run is bf16, Adam
(torch's default implementation), gradient clipping at the config's ``clip_grad``. Noise is drawn
on the device (the textbook way). Packs come from the same mock loader as dfm's, regrouped into
fixed-size batches of one latent shape (see ``reference_dit.batches_from_pack``).
"""

from __future__ import annotations

import torch

from benchmarks.reference_dit import ReferenceDiT, ShapeBatch, batches_from_pack
from benchmarks.timing import Timing, peak_memory_gib, reset_memory, start_clock, stop_clock
from dfm.diffusion.pipeline import pipeline_from_config
from dfm.parallel import ParallelLayout
from dfm.training.data import build_mock_loader
from dfm.training.setup import num_microbatches


def build_reference(cfg, device: torch.device) -> tuple[ReferenceDiT, torch.optim.Optimizer]:
    torch.manual_seed(cfg.rng.seed)
    with torch.device(device):
        model = ReferenceDiT(cfg.model)
    o = cfg.optimizer
    optimizer = torch.optim.Adam(
        model.parameters(), lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps, weight_decay=o.weight_decay
    )
    return model, optimizer


def batch_loss(model, pipeline, batch: ShapeBatch, autocast) -> torch.Tensor:
    """Summed per-sample loss of one fixed-size batch."""
    b, length, dim = batch.latents.shape
    x0 = batch.latents.flatten(0, 1)
    sample_ids = torch.arange(b, device=x0.device).repeat_interleave(length)
    noise, level = pipeline.draw_training_noise(b, x0.shape, device=x0.device)
    x_in, c_noise = pipeline.model_input(x0, noise, level, sample_ids)
    with autocast:
        out = model(x_in.view(b, length, dim), c_noise, batch.pos_ids, batch.text, batch.text_mask)
    per_sample = pipeline.training_loss(
        out.flatten(0, 1).float(), x0, noise, level, sample_ids, torch.ones_like(x0[:, 0])
    )
    return per_sample.sum()


def reference_step(cfg, model, optimizer, pipeline, packs: list, device, autocast) -> list:
    """One optimizer step over ``packs`` (the micro-batches); returns the packs' (video, text) lengths."""
    optimizer.zero_grad(set_to_none=True)
    lengths = []
    n_micro = len(packs)
    for pack in packs:
        lengths.append(
            (
                pack.host_sample_lengths(),
                pack.host_text_lengths(),
            )
        )
        # dfm's loss is the mean over a pack's samples, averaged over micro-batches: match it.
        weight = 1.0 / (pack.num_samples * n_micro)
        for batch in batches_from_pack(pack):
            (batch_loss(model, pipeline, batch.to(device), autocast) * weight).backward()
    if cfg.optimizer.clip_grad:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.clip_grad)
    optimizer.step()
    return lengths


def time_reference(cfg, device: torch.device, warmup: int, steps: int, profiler=None) -> Timing:
    reset_memory(device)
    model, optimizer = build_reference(cfg, device)
    pipeline = pipeline_from_config(cfg)
    layout = ParallelLayout.from_config(cfg.model, torch.distributed.get_world_size())
    loader = build_mock_loader(cfg, layout)
    n_micro = num_microbatches(cfg, layout)
    bf16 = cfg.mixed_precision.precision == "bf16"
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    start, packs = 0.0, []
    for step in range(warmup + steps):
        if step == warmup:
            start = start_clock(device)
            packs = []
            if profiler is not None:
                profiler.start()
        micro_batches = [next(loader) for _ in range(n_micro)]
        packs += reference_step(cfg, model, optimizer, pipeline, micro_batches, device, autocast)
    elapsed = stop_clock(device, start)
    if profiler is not None:
        profiler.stop()
    return Timing(
        elapsed_s=elapsed,
        steps=steps,
        video_lens=[n for q, _ in packs for n in q],
        text_lens=[n for _, kv in packs for n in kv],
        peak_mem_gib=peak_memory_gib(device),
    )
