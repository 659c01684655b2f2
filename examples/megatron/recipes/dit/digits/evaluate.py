"""Score a digits checkpoint: generate from every caption with classifier-free guidance and without
text, classify the samples, report the fraction classified as the prompted digit.

    python -m digits.evaluate --checkpoint CKPT [CKPT ...] --t5 T5_DIR --vae VAE_DIR --json scores.json

Conditional accuracy should be far above chance (0.1) once the model learns; unconditional samples
(null text, no guidance) are scored against the same labels, so they sit near chance.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from dfm.diffusion.pipeline import pipeline_from_config
from dfm.inference.checkpoint_loading import checkpoint_config, checkpoint_directory, load_model, single_process_config
from dfm.inference.encoders import Encoders, EncoderSources, check_encoders_match, load_encoders
from dfm.inference.generation_batch import draw_noise, generation_pack, null_text_batch
from dfm.inference.sampling import sample_latents
from digits.classifier import DigitClassifier, train_digit_classifier
from digits.data import DIGIT_SIZE, DIGIT_WORDS, digit_caption, video_to_digit_pixels


@dataclass(frozen=True)
class DigitSampling:
    samples_per_digit: int = 20
    steps: int = 18  # EDM Heun: 2 model calls per step; flow Euler: 1
    guidance_scale: float = 3.0
    sampler: str | None = None  # None: the pipeline's default (EDM heun, flow euler)
    seed: int = 0


@dataclass
class DigitScores:
    iteration: int
    pipeline: str
    conditional_accuracy: float
    unconditional_accuracy: float
    samples: list  # conditional samples [N][8][8] in 0..16 (for grids), digit-major order


def iteration_of(directory: Path) -> int:
    match = re.search(r"iter_(\d+)$", directory.name)
    return int(match.group(1)) if match else -1


def prompted_labels(sampling: DigitSampling) -> np.ndarray:
    """[10 * samples_per_digit]: 0, 0, ..., 1, 1, ..."""
    return np.repeat(np.arange(len(DIGIT_WORDS)), sampling.samples_per_digit)


def generate_digits(model, cfg, encoders: Encoders, sampling: DigitSampling, conditional: bool, device) -> np.ndarray:
    """All prompts in one pack -> pixels [N, 8, 8] in 0..16. Unconditional: null text, no guidance."""
    labels = prompted_labels(sampling)
    texts = encoders.text.encode([digit_caption(d) for d in range(len(DIGIT_WORDS))])
    shape = (cfg.model.in_channels, 1, DIGIT_SIZE, DIGIT_SIZE)
    noises = [draw_noise(shape, sampling.seed * 100_003 + i) for i in range(len(labels))]
    batch = generation_pack(noises, [texts[d] for d in labels], cfg.model)
    guidance = sampling.guidance_scale if conditional else 1.0
    if not conditional:
        batch = null_text_batch(batch)
    latents = sample_latents(
        model,
        pipeline_from_config(cfg),
        cfg.model.pipeline,
        batch.to(device),
        cfg.model,
        sampling.steps,
        guidance,
        sampling.sampler,
        sampling.seed,
    )
    video = encoders.vae.decode(torch.stack(latents))  # [N, 3, 1, H, W] in [-1, 1]
    return video_to_digit_pixels(video[:, :, 0].mean(dim=1).cpu().numpy())


def score_checkpoint(
    path: str | Path, sources: EncoderSources, classifier: DigitClassifier, sampling: DigitSampling, device
) -> DigitScores:
    """Needs megatron's parallel state (``initialize_distributed()``); one process, TP = PP = 1."""
    directory = checkpoint_directory(path)
    cfg = single_process_config(checkpoint_config(directory))
    model = load_model(cfg, directory, device)
    encoders = load_encoders(sources, cfg.model.max_text_len, device)
    check_encoders_match(encoders, cfg.model)
    labels = prompted_labels(sampling)
    conditional = generate_digits(model, cfg, encoders, sampling, True, device)
    unconditional = generate_digits(model, cfg, encoders, sampling, False, device)
    return DigitScores(
        iteration=iteration_of(directory),
        pipeline=cfg.model.pipeline,
        conditional_accuracy=classifier.accuracy(conditional, labels),
        unconditional_accuracy=classifier.accuracy(unconditional, labels),
        samples=conditional.round(3).tolist(),
    )


def score_checkpoints(
    paths: Sequence[str | Path], sources: EncoderSources, sampling: DigitSampling
) -> list[DigitScores]:
    """Score each checkpoint in this process (starts and ends a one-process torch.distributed)."""
    from dfm.platform.distributed import destroy_distributed, initialize_distributed

    classifier = train_digit_classifier()
    device = initialize_distributed(seed=sampling.seed)
    try:
        return [score_checkpoint(path, sources, classifier, sampling, device) for path in paths]
    finally:
        destroy_distributed()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = DigitSampling()
    p.add_argument("--checkpoint", nargs="+", required=True, help="iter_N directories or roots with 'latest'")
    p.add_argument("--t5", required=True, help="the T5 folder the dataset was prepared with")
    p.add_argument("--vae", default="identity_grey", help="the identity VAE (name or folder) it was prepared with")
    p.add_argument("--samples_per_digit", type=int, default=defaults.samples_per_digit)
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--guidance_scale", type=float, default=defaults.guidance_scale)
    p.add_argument("--sampler", default=None)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--json", help="write the scores here (a list, one entry per checkpoint)")
    return p


def main(argv: Sequence[str] | None = None) -> list[DigitScores]:
    args = build_parser().parse_args(argv)
    sampling = DigitSampling(args.samples_per_digit, args.steps, args.guidance_scale, args.sampler, args.seed)
    sources = EncoderSources(t5=args.t5, vae=args.vae, vae_subfolder=None)
    scores = score_checkpoints(args.checkpoint, sources, sampling)
    for s in scores:
        print(
            f"{s.pipeline} iteration {s.iteration}: conditional accuracy: {s.conditional_accuracy:.2f}, "
            f"unconditional accuracy: {s.unconditional_accuracy:.2f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(s) for s in scores]))
    return scores


if __name__ == "__main__":  # dist_checkpointing may start worker processes: keep this guard
    main()
