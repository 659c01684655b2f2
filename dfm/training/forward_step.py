"""The megatron ``forward_step_func``: noise a pack with the pipeline, run the model, masked loss."""

from __future__ import annotations

import dataclasses
import zlib
from functools import partial

import torch

from dfm.data.packed_batch import PackedBatch
from dfm.data.video_condition import as_text_to_video, text_to_video_samples
from dfm.diffusion.first_frame import keep_first_frames_clean
from dfm.diffusion.pipeline import DRAW_INTO, DiffusionPipeline, null_dropped_context
from dfm.diffusion.timestep_experts import EXPERTS, expert_of


def draw_pack_noise(
    pipeline: DiffusionPipeline, batch: PackedBatch, seed: int, iteration: int, cfg_dropout_prob: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> noise [S, D] (zero on padding), level [N], text dropped [N] bool; drawn on the CPU.

    Each sample's generator draws, in order, its level's random numbers, its noise and its text-drop
    number (``draw_training_noise`` then ``cfg_drop_mask``); the loop only draws, into views made for
    the whole pack beforehand (the same numbers as ``randn`` / ``rand`` of one sample's sizes), and the
    levels and the drop decisions are made once for the pack from the drawn numbers."""
    lengths = batch.host_sample_lengths()
    noise = torch.zeros(batch.latents.shape, dtype=torch.float32)
    padded = batch.host_view().padded_sample_lengths.tolist()
    rows = [room if n == room_n else room[:n] for room, n, room_n in zip(noise.split(padded), lengths, padded)]
    fills = [DRAW_INTO[kind] for kind in pipeline.level_draw_kinds()]
    width = len(fills) + 1
    drawn = torch.empty(len(lengths), width)  # per sample: its level's numbers, then its text-drop number
    cells = drawn.view(-1).unbind()  # one view per number, made at once
    # Each sample's generator is seeded from crc32("seed:iteration:index"): its draws depend only on those,
    # not on the layout. The CRC of the common prefix is continued by each index; reseeding resets all of
    # a generator's state (the same draws as a new one).
    crc = zlib.crc32(f"{seed}:{iteration}:".encode())
    seeds = [zlib.crc32(str(index).encode(), crc) for index in batch.sample_index.tolist()]
    level_cells = list(zip(*(cells[k::width] for k in range(width - 1)))) or [()] * len(seeds)  # per sample
    reused = torch.Generator()
    for sample_seed, row, own, drop in zip(seeds, rows, level_cells, cells[width - 1 :: width]):
        generator = reused.manual_seed(sample_seed)
        for fill, cell in zip(fills, own):
            fill(cell, generator=generator)
        row.normal_(generator=generator)
        drop.uniform_(generator=generator)
    level = pipeline.levels_from_draws(tuple(drawn[:, :-1].t()), tokens=lengths)
    return noise, level, drawn[:, -1] < cfg_dropout_prob


class DiffusionForwardStep:
    """Callable as megatron's forward_step_func(data_iterator, model); ``iteration`` is set by the loop."""

    def __init__(
        self,
        pipeline: DiffusionPipeline,
        seed: int,
        cfg_dropout_prob: float,
        device: torch.device,
        i2v_prob: float = 0.0,
        expert_boundary: float | None = None,
    ):
        self.pipeline = pipeline
        # Wan 2.2 both experts (model.wan_expert=both): each sample goes to the expert of its drawn t.
        self.expert_boundary = expert_boundary
        self.i2v_prob = i2v_prob  # HunyuanVideo 1.5: image-to-video samples' share
        self.seed = seed
        self.cfg_dropout_prob = cfg_dropout_prob
        self.device = device
        self.iteration = 0
        self.fixed_level: float | None = None  # validation: every sample at this level (noise still drawn)

    def prepare(self, batch: PackedBatch) -> tuple[PackedBatch, torch.Tensor, torch.Tensor]:
        noise, level, dropped = draw_pack_noise(self.pipeline, batch, self.seed, self.iteration, self.cfg_dropout_prob)
        if self.fixed_level is not None:
            level = torch.full_like(level, self.fixed_level)
        context = null_dropped_context(batch.context, batch.cu_seqlens_kv_padded, dropped)
        pooled = batch.pooled_text
        if pooled is not None:  # the pooled text vector (FLUX) is dropped with its sample's text
            pooled = torch.where(dropped[:, None], torch.zeros_like(pooled), pooled)
        batch = dataclasses.replace(batch, context=context, pooled_text=pooled, **self.conditions(batch, dropped))
        if self.expert_boundary is not None:
            batch = dataclasses.replace(batch, expert_ids=expert_of(level, self.expert_boundary))
        return batch.to(self.device), noise.to(self.device), level.to(self.device)

    def conditions(self, batch: PackedBatch, dropped: torch.Tensor) -> dict:
        """HunyuanVideo 1.5 packs: each sample text- or image-to-video (``i2v_prob``), its ByT5 text
        dropped with its text; other packs: nothing to change."""
        if batch.condition is None:
            return {}
        text_to_video = text_to_video_samples(batch, self.seed, self.iteration, self.i2v_prob)
        context_2 = null_dropped_context(batch.context_2, batch.cu_seqlens_kv2_padded, dropped)
        return dict(context_2=context_2, **as_text_to_video(batch, text_to_video))

    def __call__(self, data_iterator, model):
        return self.run(model, *self.prepare(next(data_iterator)))

    def run(self, model, batch: PackedBatch, noise: torch.Tensor, level: torch.Tensor):
        """The device part of a micro-batch: model input, model, and the loss closure. No host sync
        (tests/training/test_no_host_sync.py): the host-side work is all in ``prepare``."""
        sample_ids = batch.token_sample_ids()
        x_in, c_noise = self.pipeline.model_input(batch.latents, noise, level, sample_ids)
        x_in, loss_batch = keep_first_frames_clean(x_in, batch)
        output = model(x_in, c_noise, batch)
        return output, partial(self.loss, loss_batch, noise, level, sample_ids)

    def loss(self, batch: PackedBatch, noise, level, sample_ids, output: torch.Tensor):
        per_sample = self.pipeline.training_loss(output, batch.latents, noise, level, sample_ids, batch.loss_mask)
        loss = per_sample.mean()
        stats = torch.stack([loss.detach().float(), batch.loss_mask.detach().sum().float()])
        if batch.expert_ids is None:
            return loss, {"loss_and_tokens": stats}
        return loss, {"loss_and_tokens": stats, "expert_losses": expert_loss_sums(per_sample, batch.expert_ids)}


def expert_loss_sums(per_sample: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """[2 * experts]: per expert (EXPERTS' order) the sum of its samples' losses and their count."""
    one_hot = torch.nn.functional.one_hot(expert_ids, len(EXPERTS)).float()
    sums = one_hot.T @ per_sample.detach().float()
    return torch.stack([sums, one_hot.sum(0)], dim=1).flatten()
