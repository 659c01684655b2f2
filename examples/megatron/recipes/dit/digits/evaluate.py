"""Score a digits checkpoint: generate from every caption with classifier-free guidance and without
text, classify the samples, report the fraction classified as the prompted digit (and, for moving-digit
clips, the fraction moving as prompted and how steadily each clip shows one digit).

    python -m digits.evaluate --checkpoint CKPT [CKPT ...] --t5 T5_DIR --vae VAE_DIR --json scores.json

Conditional accuracy should be far above chance (0.1) once the model learns; unconditional samples
(null text, no guidance) are scored against the same labels, so they sit near chance (motion: 0.2).
Images also get their diversity against the real digits' and the fraction of near copies (digits.diversity).

A DMD2 student (a checkpoint saved with ``distill.enabled=true``) samples its own way, as
inference_dit_model.py samples it: over its ``distill.student_timesteps`` with the dmd2 sampler, unguided
(``--steps``, ``--guidance_scale`` and ``--sampler`` are ignored for it).
"""

from __future__ import annotations

import argparse
import functools
import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from dfm.diffusion.pipeline import SamplingOptions
from dfm.diffusion.registry import pipeline_from_config
from dfm.inference.checkpoint_loading import checkpoint_config, checkpoint_directory, load_model, single_process_config
from dfm.inference.encoders import Encoders, EncoderSources, check_encoders_match, load_encoders
from dfm.inference.generation_batch import draw_noise, generation_pack, null_text_batch
from dfm.inference.sampling import sample_latents
from dfm.inference.student import DMD2, is_student, sample_student_latents
from dfm.platform.process_exit import skip_final_gc_at_exit
from digits.classifier import DigitClassifier, train_digit_classifier
from digits.clip_scores import judge_clips, motion_accuracy
from digits.clips import ClipSpec, all_captions, clip_caption
from digits.data import DIGIT_WORDS, digit_caption, video_to_digit_pixels
from digits.diversity import diversity_scores


@dataclass(frozen=True)
class DigitSampling:
    samples_per_caption: int = 20  # images: per digit; clips: per (digit, motion)
    steps: int = 18  # EDM Heun: 2 model calls per step; flow Euler: 1
    guidance_scale: float = 3.0
    sampler: str | None = None  # None: the pipeline's default (EDM heun, flow euler)
    seed: int = 0


@dataclass
class DigitScores:
    iteration: int
    pipeline: str
    architecture: str
    conditional_accuracy: float  # clips: the majority digit of each clip
    unconditional_accuracy: float
    samples: list  # conditional samples [N][T][H][W] in 0..16 (for figures), caption-major order
    motion_accuracy: float | None = None  # clips only
    unconditional_motion_accuracy: float | None = None
    temporal_consistency: float | None = None  # clips only: frames agreeing with their clip's majority
    diversity_ratio: float | None = None  # images only: digits.diversity, of the conditional samples
    near_copy_fraction: float | None = None
    nearest_ratio: float | None = None
    student_timesteps: list | None = None  # a DMD2 student's own times (it sampled at those, unguided)


@dataclass(frozen=True)
class Prompts:
    captions: list[str]  # one per sample
    digits: np.ndarray  # [N] the digit each caption names
    motions: list[str] | None  # clips: the motion each caption names


def iteration_of(directory: Path) -> int:
    match = re.search(r"iter_(\d+)$", directory.name)
    return int(match.group(1)) if match else -1


def is_clip_config(cfg) -> bool:
    """Clip checkpoints were trained on T > 1 frames (``model.max_latent_thw`` is the data's latent size)."""
    return cfg.model.max_latent_thw[0] > 1


def digit_prompts(sampling: DigitSampling) -> Prompts:
    """Each digit's caption ``samples_per_caption`` times: 0, 0, ..., 1, 1, ..."""
    digits = np.repeat(np.arange(len(DIGIT_WORDS)), sampling.samples_per_caption)
    return Prompts([digit_caption(int(d)) for d in digits], digits, None)


def clip_prompts(sampling: DigitSampling) -> Prompts:
    """Each (digit, motion) caption ``samples_per_caption`` times, digit-major."""
    pairs = [pair for pair in all_captions() for _ in range(sampling.samples_per_caption)]
    return Prompts([clip_caption(d, m) for d, m in pairs], np.array([d for d, _ in pairs]), [m for _, m in pairs])


def generate_digits(
    model, cfg, encoders: Encoders, captions: list[str], sampling: DigitSampling, conditional: bool, device
) -> np.ndarray:
    """One sample per caption, all in one pack, at the trained latent size ``model.max_latent_thw``
    -> pixels [N, T, H, W] in 0..16. Unconditional: null text, no guidance."""
    embeddings = caption_embeddings(encoders, captions)
    noises = prompt_noises((cfg.model.in_channels, *cfg.model.max_latent_thw), len(captions), sampling)
    batch = generation_pack(noises, [embeddings[c] for c in captions], cfg.model)
    guidance = sampling.guidance_scale if conditional else 1.0
    if not conditional:
        batch = null_text_batch(batch)
    if is_student(cfg):  # its own timesteps, unguided: the teacher's guidance is baked in
        latents = sample_student_latents(model, pipeline_from_config(cfg), batch.to(device), cfg, DMD2, sampling.seed)
    else:
        options = SamplingOptions(sampling.steps, guidance, sampling.sampler, sampling.seed)
        latents = sample_latents(model, pipeline_from_config(cfg), batch.to(device), cfg.model, options)
    return latents_to_pixels(encoders, torch.stack(latents))


def caption_embeddings(encoders: Encoders, captions: list[str]) -> dict[str, torch.Tensor]:
    """Each distinct caption -> its T5 embedding [L, D] (unpadded, as the shards hold them)."""
    unique = sorted(set(captions))
    return dict(zip(unique, encoders.text.encode(unique)))


def prompt_noises(shape: tuple[int, ...], count: int, sampling: DigitSampling) -> list[torch.Tensor]:
    """The starting noise [C, T, H, W] of samples 0 .. count - 1 (sample i from seed ``seed * 100003 + i``),
    so any model scored with the same ``sampling`` starts from the same noise."""
    return [draw_noise(shape, sampling.seed * 100_003 + i) for i in range(count)]


def latents_to_pixels(encoders: Encoders, latents: torch.Tensor) -> np.ndarray:
    """Clean latents [N, C, T, H, W] -> pixels [N, T, H, W] in 0..16 through the VAE (channels averaged)."""
    video = encoders.vae.decode(latents)  # [N, 3, T, H, W] in [-1, 1]
    return video_to_digit_pixels(video.mean(dim=1).cpu().numpy())


@functools.cache
def digit_classifier(centred: bool) -> DigitClassifier:
    return train_digit_classifier(centred=centred)


def score_samples(prompts: Prompts, conditional: np.ndarray, unconditional: np.ndarray) -> dict:
    """Images: the fraction classified as prompted, and the conditional samples' diversity and near copies.
    Clips: also motion and temporal consistency."""
    if prompts.motions is None:
        classifier = digit_classifier(centred=False)
        return dict(
            conditional_accuracy=classifier.accuracy(conditional[:, 0], prompts.digits),
            unconditional_accuracy=classifier.accuracy(unconditional[:, 0], prompts.digits),
            **asdict(diversity_scores(conditional[:, 0], prompts.digits)),
        )
    classify = digit_classifier(centred=True).predict
    still_below = ClipSpec(canvas=conditional.shape[-1], frames=conditional.shape[1]).travel / 2
    cond, uncond = (judge_clips(clips, classify, still_below) for clips in (conditional, unconditional))
    return dict(
        conditional_accuracy=float(np.mean(cond.digits == prompts.digits)),
        unconditional_accuracy=float(np.mean(uncond.digits == prompts.digits)),
        motion_accuracy=motion_accuracy(cond.motions, prompts.motions),
        unconditional_motion_accuracy=motion_accuracy(uncond.motions, prompts.motions),
        temporal_consistency=float(cond.consistency.mean()),
    )


def score_checkpoint(path: str | Path, sources: EncoderSources, sampling: DigitSampling, device) -> DigitScores:
    """Needs megatron's parallel state (``initialize_distributed()``); one process, TP = PP = 1."""
    directory = checkpoint_directory(path)
    cfg = single_process_config(checkpoint_config(directory))
    model = load_model(cfg, directory, device)
    encoders = load_encoders(sources, cfg.model.max_text_len, device)
    check_encoders_match(encoders, cfg.model)
    prompts = clip_prompts(sampling) if is_clip_config(cfg) else digit_prompts(sampling)
    conditional = generate_digits(model, cfg, encoders, prompts.captions, sampling, True, device)
    unconditional = generate_digits(model, cfg, encoders, prompts.captions, sampling, False, device)
    return DigitScores(
        iteration=iteration_of(directory),
        pipeline=cfg.model.pipeline,
        architecture=cfg.model.architecture,
        samples=conditional.round(2).tolist(),
        student_timesteps=cfg.distill.student_timesteps if is_student(cfg) else None,
        **score_samples(prompts, conditional, unconditional),
    )


def score_checkpoints(
    paths: Sequence[str | Path], sources: EncoderSources, sampling: DigitSampling
) -> list[DigitScores]:
    """Score each checkpoint in this process (starts and ends a one-process torch.distributed)."""
    from dfm.platform.distributed import destroy_distributed, initialize_distributed

    device = initialize_distributed(seed=sampling.seed)
    try:
        return [score_checkpoint(path, sources, sampling, device) for path in paths]
    finally:
        destroy_distributed()


def describe(s: DigitScores) -> str:
    """The figures as docs/learning.md quotes them."""
    if s.motion_accuracy is None:
        return f"conditional accuracy: {s.conditional_accuracy:.2f}, unconditional accuracy: {s.unconditional_accuracy:.2f}"
    return (
        f"video conditional accuracy: {s.conditional_accuracy:.2f}, motion accuracy: {s.motion_accuracy:.2f}, "
        f"temporal consistency: {s.temporal_consistency:.2f}; unconditional: content "
        f"{s.unconditional_accuracy:.2f}, motion {s.unconditional_motion_accuracy:.2f}"
    )


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    """``DigitSampling``'s fields as flags (this script and the demos)."""
    defaults = DigitSampling()
    p.add_argument("--samples_per_caption", type=int, default=defaults.samples_per_caption)
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--guidance_scale", type=float, default=defaults.guidance_scale)
    p.add_argument("--sampler", default=None)
    p.add_argument("--seed", type=int, default=defaults.seed)


def sampling_from_args(args: argparse.Namespace) -> DigitSampling:
    return DigitSampling(args.samples_per_caption, args.steps, args.guidance_scale, args.sampler, args.seed)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", nargs="+", required=True, help="iter_N directories or roots with 'latest'")
    p.add_argument("--t5", required=True, help="the T5 folder the dataset was prepared with")
    p.add_argument("--vae", default="identity_grey", help="the identity VAE (name or folder) it was prepared with")
    add_sampling_arguments(p)
    p.add_argument("--json", help="write the scores here (a list, one entry per checkpoint)")
    return p


def main(argv: Sequence[str] | None = None) -> list[DigitScores]:
    args = build_parser().parse_args(argv)
    sampling = sampling_from_args(args)
    sources = EncoderSources(t5=args.t5, vae=args.vae, vae_subfolder=None)
    scores = score_checkpoints(args.checkpoint, sources, sampling)
    for s in scores:
        print(f"{s.architecture} {s.pipeline} iteration {s.iteration}: {describe(s)}")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(s) for s in scores]))
    return scores


if __name__ == "__main__":  # dist_checkpointing may start worker processes: keep this guard
    skip_final_gc_at_exit()
    main()
