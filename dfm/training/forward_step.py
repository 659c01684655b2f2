"""The megatron ``forward_step_func``: noise a pack with the pipeline, run the model, masked loss."""

from __future__ import annotations

import dataclasses
from functools import partial

import torch

from dfm.data.pack_draws import DrawSettings, draw_pack
from dfm.data.packed_batch import PackedBatch
from dfm.data.video_condition import as_text_to_video, text_to_video_samples
from dfm.diffusion.first_frame import keep_first_frames_clean
from dfm.diffusion.pipeline import DiffusionPipeline, null_dropped_context
from dfm.diffusion.timestep_experts import EXPERTS, expert_of


def draw_pack_noise(
    pipeline: DiffusionPipeline, batch: PackedBatch, seed: int, cfg_dropout_prob: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> noise [S, D] (zero on padding), level [N], text dropped [N] bool; on the CPU.

    From the draws the loader attached to ``batch`` (dfm/data/pack_draws.py), or drawn here the same way
    for a pack made elsewhere; the levels and the drop decisions are made once for the pack from them."""
    settings = DrawSettings(seed, pipeline.level_draw_kinds())
    noise, numbers = batch.noise, batch.draws
    if noise is None or numbers is None:
        noise, numbers = draw_pack(batch, settings)
    elif numbers.shape[1] != len(settings.level_kinds) + 1:
        raise ValueError(
            f"the pack's draws hold {numbers.shape[1]} numbers a sample; the pipeline reads "
            f"{len(settings.level_kinds)} level numbers and a text-drop number (loader and step built apart?)"
        )
    level = pipeline.levels_from_draws(tuple(numbers[:, :-1].t()), tokens=batch.host_sample_lengths())
    return noise, level, numbers[:, -1] < cfg_dropout_prob


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
        noise, level, dropped = draw_pack_noise(self.pipeline, batch, self.seed, self.cfg_dropout_prob)
        if self.fixed_level is not None:
            level = torch.full_like(level, self.fixed_level)
        context = null_dropped_context(batch.context, batch.cu_seqlens_kv_padded, dropped)
        pooled = batch.pooled_text
        if pooled is not None:  # the pooled text vector (FLUX) is dropped with its sample's text
            pooled = torch.where(dropped[:, None], torch.zeros_like(pooled), pooled)
        # The draws leave the pack here: the noise goes to the device once, beside it.
        conditions = self.conditions(batch, dropped)
        batch = dataclasses.replace(batch, context=context, pooled_text=pooled, noise=None, draws=None, **conditions)
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
