"""Time the plain-PyTorch reference DiT on the same packs, with the same optimizer settings.

Textbook training: fp32 parameters, ``torch.autocast`` to bf16 when the run is bf16, Adam
(torch's default implementation), gradient clipping at the config's ``clip_grad``. Noise is drawn
on the device (the textbook way). Packs come from the same mock loader as dfm's, drawn and regrouped
into dense batches of one latent shape (``reference_dit.batches_from_pack``) on the device before the
clock starts: a researcher's loader hands over ready batches.
"""

from __future__ import annotations

import time

import torch

from benchmarks.reference_dit import ReferenceDiT, ShapeBatch, batches_from_pack
from benchmarks.timing import Timing, draw_packs, reset_memory, time_sides
from dfm.diffusion.registry import pipeline_from_config
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


def batch_loss(model, pipeline, batch: ShapeBatch, autocast, text_drop: float = 0.0) -> torch.Tensor:
    """Summed per-sample loss of one dense batch, each caption dropped (zeroed) with ``text_drop``'s
    probability, as dfm's training drops them for classifier-free guidance."""
    b, length, dim = batch.latents.shape
    x0 = batch.latents.flatten(0, 1)
    sample_ids = torch.arange(b, device=x0.device).repeat_interleave(length)
    noise, level = pipeline.draw_training_noise(b, x0.shape, device=x0.device)
    x_in, c_noise = pipeline.model_input(x0, noise, level, sample_ids)
    text = batch.text
    if text_drop and text is not None:
        text = text.masked_fill((torch.rand(b, device=text.device) < text_drop)[:, None, None], 0.0)
    with autocast:
        out = model(x_in.view(b, length, dim), c_noise, batch.pos_ids, text, batch.text_mask)
    per_sample = pipeline.training_loss(
        out.flatten(0, 1).float(), x0, noise, level, sample_ids, torch.ones_like(x0[:, 0])
    )
    return per_sample.sum()


def reference_step(cfg, model, optimizer, pipeline, micro_batches: list, autocast) -> None:
    """One optimizer step; ``micro_batches``: per pack, (its dense batches, its sample count)."""
    optimizer.zero_grad(set_to_none=True)
    for batches, num_samples in micro_batches:
        # dfm's loss is the mean over a pack's samples, averaged over micro-batches: match it.
        weight = 1.0 / (num_samples * len(micro_batches))
        for batch in batches:
            loss = batch_loss(model, pipeline, batch, autocast, cfg.dataset.cfg_dropout_prob)
            (loss * weight).backward()
    if cfg.optimizer.clip_grad:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.clip_grad)
    optimizer.step()


class ReferenceSide:
    """The reference model and optimizer over ``total_steps`` steps' packs, regrouped into dense batches
    on the device beforehand."""

    def __init__(self, cfg, device: torch.device, total_steps: int):
        self.cfg = cfg
        self.model, self.optimizer = build_reference(cfg, device)
        self.pipeline = pipeline_from_config(cfg)
        layout = ParallelLayout.from_config(cfg.model, torch.distributed.get_world_size())
        self.packs = draw_packs(build_mock_loader(cfg, layout), total_steps, num_microbatches(cfg, layout))
        self.batches = [
            [([b.to(device) for b in batches_from_pack(p)], p.num_samples) for p in step] for step in self.packs
        ]
        bf16 = cfg.mixed_precision.precision == "bf16"
        self.autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)

    def step(self, index: int) -> None:
        reference_step(self.cfg, self.model, self.optimizer, self.pipeline, self.batches[index], self.autocast)


def time_reference(
    cfg, device: torch.device, warmup: int, steps: int, profiler=None, clock=time.perf_counter
) -> Timing:
    """The reference alone; ``profiler`` records the timed steps only."""
    reset_memory(device)
    return time_sides([ReferenceSide(cfg, device, warmup + steps)], device, warmup, steps, profiler, clock)[0]
