"""Run the config's diffusion pipeline over the trained model, with a progress bar."""

from __future__ import annotations

from collections.abc import Callable

import torch
from tqdm import tqdm

from dfm.data.packed_batch import PackedBatch
from dfm.data.patchify import unpatchify
from dfm.diffusion.first_frame import keep_first_frames_clean
from dfm.diffusion.pipeline import DiffusionPipeline, SamplingOptions
from dfm.diffusion.timestep_experts import sampling_net
from dfm.inference.generation_batch import null_text_batch


class ProgressNet:
    """``net(x_in [S, D], c_noise [N], batch) -> raw [S, D]`` around the model, ticking a progress bar."""

    def __init__(self, model: torch.nn.Module, progress: tqdm):
        self.model, self.progress = model, progress
        self.dtype = next(model.parameters()).dtype

    def __call__(self, x_in: torch.Tensor, c_noise: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        # TI2V (Wan 2.2): the image's first-frame tokens stay the clean condition at every step.
        x_in, _ = keep_first_frames_clean(x_in, batch)
        # The pipeline integrates in fp32; a bf16 model gets bf16 inputs (as in training).
        out = self.model(x_in.to(self.dtype), c_noise, batch)
        self.progress.update(1)
        return out


def sample_latent(*args, **kwargs) -> torch.Tensor:
    """``sample_latents`` for a one-sample pack -> its clean latent [C, T', H', W']."""
    return sample_latents(*args, **kwargs)[0]


@torch.no_grad()
def sample_latents(
    model: torch.nn.Module,
    pipeline: DiffusionPipeline,
    batch: PackedBatch,
    model_cfg,
    options: SamplingOptions,
    uncond: PackedBatch | None = None,
) -> list[torch.Tensor]:
    """Denoise ``batch.latents`` (the starting noise of every sample in the pack) at once
    -> one clean latent [C, T', H', W'] per sample.

    Guidance scale 1 (every step's) is the conditional prediction alone, so the unconditional pass is skipped.
    ``uncond``: the unconditional pass's pack (a negative prompt's text, as Wan samples); None: the
    text zeroed, as cfg dropout trains it. A both-experts model samples as ``sampling_net`` routes it.
    """
    guided = options.guided
    solver = pipeline.sampler(options.sampler)

    def integrate(net: ProgressNet) -> torch.Tensor:
        return pipeline.sample(
            net,
            batch.latents,
            batch.token_sample_ids(),
            options,
            cond={"batch": batch},
            uncond={"batch": uncond if uncond is not None else null_text_batch(batch)} if guided else None,
        )

    calls = solver.model_calls(options.steps, guided)
    return denoised_latents(model, pipeline, batch, model_cfg, integrate, calls, f"{solver.name} {options.steps} steps")


def denoised_latents(
    model: torch.nn.Module,
    pipeline: DiffusionPipeline,
    batch: PackedBatch,
    model_cfg,
    integrate: Callable[[ProgressNet], torch.Tensor],
    calls: int,
    label: str,
) -> list[torch.Tensor]:
    """``integrate(net)``: the clean tokens [S, D] of the pack, from the model as ``net`` (a progress bar of
    ``calls`` model calls, labelled ``label``) -> one clean latent [C, T', H', W'] per sample."""
    net = sampling_net(model, model_cfg, pipeline)
    with tqdm(total=calls, desc=f"{pipeline.name}/{label}", unit="eval") as progress:
        latents = integrate(ProgressNet(net, progress))
    latents, _ = keep_first_frames_clean(latents, batch)
    return unpack_latents(latents, batch, model_cfg)


def unpack_latents(latents: torch.Tensor, batch: PackedBatch, model_cfg) -> list[torch.Tensor]:
    """Packed tokens [S, D] -> each sample's latent [C, T', H', W'] (padding dropped)."""
    starts = batch.cu_seqlens_q_padded[:-1].tolist()
    lengths = batch.host_sample_lengths()
    return [
        unpatchify(
            latents[start : start + length].float(), tuple(shape), model_cfg.patch_temporal, model_cfg.patch_spatial
        )
        for start, length, shape in zip(starts, lengths, batch.latent_shape.tolist())
    ]
