"""Text-to-video / image generation from a dfm DiT checkpoint (single process).

    python inference_dit_model.py --checkpoint_path CKPT --prompt "..." [--num_video_frames 17] \
        [--height 256 --width 256] [--num_steps 35 --guidance_scale 7 --sampler heun] [--video_save_path out.mp4]

A DMD2 student (a checkpoint whose config has distill.enabled=true) samples over its own
distill.student_timesteps, unguided: ``--sampler dmd2`` (default, its re-noising steps) or ``euler``
(dfm/inference/student.py, docs/distillation.md).

FLUX.1 (as FluxPipeline): ``--t5 FLUX.1-dev --clip FLUX.1-dev --vae FLUX.1-dev``; the prompt's T5 text at
full length and CLIP's pooled vector condition the model, ``--guidance_scale`` is the guidance-distilled
model's guidance input (no classifier-free pass), the flow shift follows the token count
(``flow.dynamic_shift``) and the latents are decoded with the VAE's shift and scaling factors.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from dfm.config.container import ConfigContainer
from dfm.data.packed_batch import PackedBatch
from dfm.data.prepare.pipeline import DEFAULT_T5, DEFAULT_VAE
from dfm.diffusion.flow import shift_for_num_tokens
from dfm.diffusion.pipeline import SamplingOptions
from dfm.diffusion.registry import pipeline_from_config
from dfm.diffusion.timestep_experts import BOTH, TimestepExperts, c_noise_boundary
from dfm.inference.checkpoint_loading import checkpoint_config, checkpoint_directory, load_model, single_process_config
from dfm.inference.encoders import (
    NEEDS_CLIP,
    EncoderSources,
    check_encoders_match,
    load_encoders,
    tiny_random_encoders,
    uses_pooled_text,
)
from dfm.inference.generation_batch import draw_noise, generation_batch, latent_shape_for
from dfm.inference.image_condition import image_inputs
from dfm.inference.media import check_output_path, to_uint8_frames, write_media
from dfm.inference.sampling import sample_latent
from dfm.inference.student import is_student, sample_student_latent, student_arguments

logger = logging.getLogger("dfm.inference")

DEFAULT_STEPS, DEFAULT_GUIDANCE = 35, 7.0  # a model trained by pretraining (a DMD2 student: dfm/inference/student.py)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint_path", required=True, help="an iter_N checkpoint directory or a root with 'latest'")
    p.add_argument(
        "--checkpoint_path_2",
        help="Wan 2.2 A14B: the low-noise expert's checkpoint (--checkpoint_path: the high-noise one); each "
        "step runs the expert of its timestep",
    )
    p.add_argument("--prompt", default="a red panda eating bamboo in a misty forest")
    p.add_argument("--height", type=int, default=256, help="pixels; a multiple of VAE compression x patch size")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--num_video_frames", type=int, default=1, help="1: an image; else 1 + 4k for the Wan VAE")
    p.add_argument("--fps", type=int, default=16)
    p.add_argument(
        "--num_steps",
        type=int,
        default=None,
        help=f"default {DEFAULT_STEPS}; a DMD2 student: its distill.student_timesteps' count (no other is accepted)",
    )
    p.add_argument(
        "--guidance_scale",
        type=float,
        default=None,
        help=f"classifier-free guidance (1 disables it; default {DEFAULT_GUIDANCE}, a DMD2 student: 1, its only "
        "value); FLUX: the distilled model's guidance input (e.g. 3.5)",
    )
    p.add_argument(
        "--guidance_scale_2",
        type=float,
        default=None,
        help="Wan 2.2 A14B (with --checkpoint_path_2, or a checkpoint of both experts): the low-noise expert's "
        "steps' guidance, as WanPipeline's guidance_scale_2 (default: --guidance_scale)",
    )
    p.add_argument(
        "--negative_prompt", default=None, help="text of the guidance's unconditional pass (Wan's); default: no text"
    )
    p.add_argument(
        "--image",
        default=None,
        help="Wan 2.2 image-to-video: TI2V, this image's latent the clean first frame; I2V-A14B, the image condition",
    )
    p.add_argument(
        "--sampler",
        default=None,
        help="edm: heun|euler; flow: euler|heun (default: the pipeline's); a DMD2 student: dmd2 (default: its "
        "re-noising steps) or euler (deterministic Euler over its timesteps)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no_ema", action="store_true", help="sample from the trained weights even if the checkpoint has EMA ones"
    )
    p.add_argument("--video_save_path", default=None, help="default: outputs/dit_sample.mp4 (or .png for 1 frame)")
    p.add_argument("--t5", default=DEFAULT_T5, help="T5 hub name or local folder")
    p.add_argument("--t5_cache_dir")
    p.add_argument("--vae", default=DEFAULT_VAE, help="VAE hub name or local folder")
    p.add_argument("--vae_subfolder", default="vae", help="'' for a folder that is the VAE itself")
    p.add_argument("--vae_kind", choices=["auto", "wan", "wan22", "kl"], default="auto")
    p.add_argument("--vae_cache_dir")
    p.add_argument("--clip", help="FLUX: CLIP text encoder folder or the FLUX.1 pipeline folder (pooled prompt)")
    p.add_argument(
        "--tiny_random_encoders",
        action="store_true",
        help="tiny random T5 (+ CLIP) + VAE shaped to the checkpoint (tests)",
    )
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("guidance_scale", "guidance_scale_2"):
        value = getattr(args, name)
        if value is not None and (not math.isfinite(value) or value < 0):
            parser.error(f"--{name} {value}: must be a finite number >= 0 (1 disables guidance)")
    if args.num_steps is not None and args.num_steps < 1:
        parser.error(f"--num_steps {args.num_steps}: must be >= 1")
    if args.video_save_path is None:
        args.video_save_path = "outputs/dit_sample" + (".mp4" if args.num_video_frames > 1 else ".png")
    check_output_path(args.video_save_path, args.num_video_frames)  # fail before loading anything
    return args


def encoders_for(args: argparse.Namespace, model_cfg, device: torch.device, scratch: Path):
    if args.tiny_random_encoders:
        return tiny_random_encoders(model_cfg, scratch / "tiny_encoders", model_cfg.max_text_len, device, args.seed)
    if uses_pooled_text(model_cfg) and args.clip is None:  # before the (large) encoders load
        raise ValueError(NEEDS_CLIP)
    sources = EncoderSources(
        t5=args.t5,
        t5_cache_dir=args.t5_cache_dir,
        vae=args.vae,
        vae_subfolder=args.vae_subfolder or None,
        vae_kind=args.vae_kind,
        vae_cache_dir=args.vae_cache_dir,
        clip=args.clip,
    )
    return load_encoders(sources, model_cfg.max_text_len, device)


def with_embedded_guidance(cfg: ConfigContainer, guidance_scale: float) -> tuple[ConfigContainer, float]:
    """-> (config to sample with, classifier-free guidance scale). FLUX is guidance-distilled: the scale
    is the model's guidance input (FLUX.1-dev; FLUX.1-schnell has none) and no unconditional pass runs."""
    if cfg.model.architecture != "flux":
        return cfg, guidance_scale
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, guidance=guidance_scale)), 1.0


def sampling_shift(cfg: ConfigContainer, num_tokens: int) -> float | None:
    """With ``flow.dynamic_shift`` the flow shift for ``num_tokens`` (FLUX); None: the config's."""
    if cfg.model.pipeline == "flow" and cfg.flow.dynamic_shift:
        return shift_for_num_tokens(num_tokens)
    return None


def prompt_batch(
    prompt: str, noise: torch.Tensor, encoders, model_cfg, images: dict, multiples: tuple[int, int] = (1, 1)
) -> PackedBatch:
    """noise [C, T', H', W'] + prompt -> a one-sample pack: the prompt's T5 text and, for FLUX, CLIP's
    pooled vector [1, D_pool]; ``images``: the image inputs (``image_inputs``: TI2V's first frame, I2V's condition);
    ``multiples``: the layout's padding (``generation_batch``)."""
    batch = generation_batch(noise, encoders.text.encode([prompt])[0], model_cfg, **images, multiples=multiples)
    if encoders.pooled is not None:
        batch.pooled_text = encoders.pooled.encode([prompt])
    return batch


def sample_prompt(
    model: torch.nn.Module,
    cfg: ConfigContainer,
    encoders,
    prompt: str,
    noise: torch.Tensor,
    args: argparse.Namespace,
    device: torch.device,
) -> torch.Tensor:
    """The clean latent [C, T', H', W'] sampled from ``noise`` for ``prompt`` (``cfg`` from
    ``with_embedded_guidance``; args: num_steps, guidance_scale(_2), sampler, seed, negative_prompt, and
    image: TI2V's first frame or I2V's condition image, encoded by ``encoders.vae``)."""
    _, guidance_scale = with_embedded_guidance(cfg, args.guidance_scale)
    images = image_inputs(encoders.vae, cfg.model, args)
    batch = prompt_batch(prompt, noise, encoders, cfg.model, images).to(device)
    if is_student(cfg):
        logger.info(
            "sampling a latent of shape %s with the DMD2 student's %s sampler", tuple(noise.shape), args.sampler
        )
        return sample_student_latent(model, pipeline_from_config(cfg), batch, cfg, args.sampler, args.seed)
    uncond = None
    if args.negative_prompt is not None:
        uncond = prompt_batch(args.negative_prompt, noise, encoders, cfg.model, images).to(device)
    logger.info("sampling a latent of shape %s (%d tokens)", tuple(noise.shape), batch.seq_len)
    options = SamplingOptions(
        args.num_steps,
        guidance_scale,
        args.sampler,
        args.seed,
        sampling_shift(cfg, batch.seq_len),
        **expert_guidance(model, cfg, args),
    )
    return sample_latent(model, pipeline_from_config(cfg), batch, cfg.model, options, uncond)


def is_expert_pair(model: torch.nn.Module, cfg: ConfigContainer) -> bool:
    """Two Wan 2.2 experts: --checkpoint_path_2's TimestepExperts, or a both-run's model."""
    return isinstance(model, TimestepExperts) or cfg.model.wan_expert == BOTH


def expert_guidance(model: torch.nn.Module, cfg: ConfigContainer, args: argparse.Namespace) -> dict:
    """SamplingOptions' guidance_scale_2 / guidance_boundary: the low-noise expert's steps (as
    TimestepExperts routes them, at the boundary in flow t) take ``--guidance_scale_2``."""
    scale_2 = getattr(args, "guidance_scale_2", None)
    if not is_expert_pair(model, cfg) or scale_2 is None:
        return {}
    return {"guidance_scale_2": scale_2, "guidance_boundary": cfg.model.wan_boundary_ratio}


def with_low_noise_expert(
    high_noise: torch.nn.Module, cfg: ConfigContainer, path: str, device: torch.device, use_ema: bool
) -> TimestepExperts:
    """The high-noise expert (of ``cfg``) and the low-noise one at ``path``, routed by timestep."""
    directory = checkpoint_directory(path)
    cfg_2 = single_process_config(checkpoint_config(directory))
    pair = (
        (cfg.model.wan_expert, cfg.model.wan_boundary_ratio),
        (cfg_2.model.wan_expert, cfg_2.model.wan_boundary_ratio),
    )
    if pair[0][0] != "high_noise" or pair[1][0] != "low_noise" or pair[0][1] != pair[1][1]:
        raise ValueError(
            f"--checkpoint_path and --checkpoint_path_2 must be the high- and low-noise experts of one boundary; "
            f"they record (model.wan_expert, model.wan_boundary_ratio) {pair[0]} and {pair[1]}"
        )
    low_noise = load_model(cfg_2, directory, device, use_ema=use_ema)
    boundary = c_noise_boundary(pipeline_from_config(cfg), cfg.model.wan_boundary_ratio)
    return TimestepExperts(high_noise, low_noise, boundary)


def with_sampling_defaults(args: argparse.Namespace, cfg: ConfigContainer) -> argparse.Namespace:
    """``args`` with --num_steps and --guidance_scale filled for the checkpoint of ``cfg`` (a DMD2
    student's: its own steps, no guidance, its sampler; student.py)."""
    if is_student(cfg):
        return student_arguments(cfg, args)
    steps = DEFAULT_STEPS if args.num_steps is None else args.num_steps
    guidance = DEFAULT_GUIDANCE if args.guidance_scale is None else args.guidance_scale
    return argparse.Namespace(**{**vars(args), "num_steps": steps, "guidance_scale": guidance})


def generate(args: argparse.Namespace, device: torch.device) -> Path:
    """Checkpoint + prompt -> written file. Needs ``initialize_distributed()`` done (TP = PP = 1)."""
    directory = checkpoint_directory(args.checkpoint_path)
    saved = single_process_config(checkpoint_config(directory))
    args = with_sampling_defaults(args, saved)
    cfg, _ = with_embedded_guidance(saved, args.guidance_scale)
    model = load_model(cfg, directory, device, use_ema=not args.no_ema)
    if args.checkpoint_path_2 is not None:
        model = with_low_noise_expert(model, cfg, args.checkpoint_path_2, device, use_ema=not args.no_ema)
    if args.guidance_scale_2 is not None and not is_expert_pair(model, cfg):  # before the encoders load
        raise ValueError(
            "--guidance_scale_2 is the low-noise expert's guidance: it needs --checkpoint_path_2 or a checkpoint "
            "of both experts (model.wan_expert=both)"
        )
    with tempfile.TemporaryDirectory(prefix="dfm_inference_") as scratch:
        encoders = encoders_for(args, cfg.model, device, Path(scratch))
    check_encoders_match(encoders, cfg.model)
    shape = latent_shape_for(encoders.vae, cfg.model, args.height, args.width, args.num_video_frames)
    latent = sample_prompt(model, cfg, encoders, args.prompt, draw_noise(shape, args.seed), args, device)
    video = encoders.vae.decode(latent.unsqueeze(0))[0]  # [3, T, H, W] in [-1, 1]
    path = write_media(to_uint8_frames(video), args.video_save_path, args.fps)
    logger.info("wrote %s", path)
    return path


def main(argv: Sequence[str] | None = None) -> Path:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("megatron").setLevel(logging.WARNING)
    from dfm.platform.distributed import destroy_distributed, initialize_distributed

    # One process at TP = PP = 1: dist_checkpointing reshards any training layout into it.
    device = initialize_distributed(seed=args.seed)
    try:
        return generate(args, device)
    finally:
        destroy_distributed()
