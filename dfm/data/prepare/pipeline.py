"""Preparation core: media folder -> encoded shards (+ optionally ``energon prepare``).

Every file is read, bucketed, VAE-encoded and caption-encoded once (a caption seen shortly before reuses its
encoding: CaptionEncodings). Files that cannot be read (decoded, captioned, bucketed) are skipped, counted,
logged as warnings and listed in the report (and in ``prepare_report.rank<R>.json``); more than
``max_skip_fraction`` of a rank's files skipped fails the run after the report. An encoder or device error
(out of memory, an encoder bug) is no property of the file: it stops the run naming the file, which stays not
done, so ``--resume`` retries it. Under torchrun each rank takes every WORLD_SIZE-th file and writes its own
shards (``rank<R>-NNNNNN.tar``); sample keys are global file indices, unique across ranks. The output folder
must be fresh, or cleared (``overwrite``), or hold an interrupted preparation to continue (``resume``); a
record per rank tells which files are done (``record.py``).
"""

from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
from tqdm import tqdm

from dfm.data.encoders.clip import CLIPPooledEncoder
from dfm.data.encoders.hunyuan import (
    HunyuanEncoders,
    HunyuanTextAdapter,
    HunyuanVAEAdapter,
    build_tiny_hunyuan_encoders,
    hunyuan_parts,
)
from dfm.data.encoders.t5 import T5TextEncoder
from dfm.data.encoders.tiny import TinyEncoderPaths, build_tiny_random_encoders, build_tiny_wan22_vae, is_tiny_random
from dfm.data.encoders.vae import VideoVAE
from dfm.data.prepare.buckets import ResolutionPolicy, resize_center_crop
from dfm.data.prepare.captions import Caption, CaptionFormat, CaptionLookup
from dfm.data.prepare.energon_prepare import run_energon_prepare
from dfm.data.prepare.media import MediaItem, find_media_files, read_media
from dfm.data.prepare.output_dir import inputs_digest, open_output_dir
from dfm.data.prepare.record import COMPLETE, PrepareRecord
from dfm.data.prepare.shards import IMAGE_CONDITION_PART, AtomicShardWriter, encode_sample_parts

logger = logging.getLogger(__name__)

DEFAULT_T5 = "google/t5-v1_1-xxl"
DEFAULT_VAE = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
# Which text encoders (and text convention) a preparation uses: T5 alone, unpadded (DiT, Wan); or
# FLUX.1's: T5 padded to max_text_len and encoded without a mask, CLIP's pooled vector, an AutoencoderKL.
# hunyuan_video15: HunyuanVideo 1.5's Qwen2.5-VL + ByT5 text, its VAE, the first frame's latent and SigLIP
# embedding (dfm/data/encoders/hunyuan.py), all from one image-to-video pipeline folder (hunyuan_name_or_dir).
EncoderSet = Literal["t5", "flux", "hunyuan_video15"]


@dataclass
class PrepareSettings:
    input_dir: str
    output_dir: str
    caption_format: CaptionFormat | None = None  # None: sidecar, then jsonl, then meta.json
    resolution_preset: str | None = None  # 256p | 512p | 768p | 1024p
    max_pixels: int | None = None
    height: int | None = None
    width: int | None = None
    num_frames: int = 17  # per video, before VAE compression (cut to 1 + k * temporal factor)
    frame_stride: int = 1
    patch_spatial: int = 2  # bucket sizes are multiples of patch_spatial * VAE spatial factor
    t5_name_or_dir: str = DEFAULT_T5
    t5_cache_dir: str | None = None
    max_text_len: int = 512  # T5 tokens; shards keep the unpadded length
    vae_name_or_dir: str = DEFAULT_VAE
    vae_subfolder: str | None = "vae"
    vae_kind: Literal["auto", "wan", "wan22", "kl"] = "auto"
    vae_cache_dir: str | None = None
    encoders: EncoderSet = "t5"
    clip_name_or_dir: str | None = None  # CLIP text encoder (encoders="flux"): a folder or a FLUX.1 pipeline folder
    hunyuan_name_or_dir: str | None = None  # encoders="hunyuan_video15": a HunyuanVideo 1.5 I2V pipeline folder
    tiny_random_encoders: bool = False  # build tiny random T5 (+ CLIP) + VAE locally instead (tests, smoke runs)
    shard_maxcount: int = 1000
    rank: int = 0
    world_size: int = 1
    device: str = "cpu"
    run_energon_prepare: bool = False  # only rank 0 of a single-process run; see docs/data.md
    overwrite: bool = False  # clear a previous preparation's shards and energon index first
    resume: bool = False  # continue an interrupted preparation with the same settings
    max_skip_fraction: float = 0.05  # more of this rank's files unreadable: the run fails (after its report)
    # Wan 2.2 TI2V: the samples train image-to-video (metadata first_frame_clean): their first latent
    # frame, which the causal Wan VAE encodes from the first frame alone, is the image's latent.
    first_frame_clean: bool = False
    # Wan 2.2 I2V-A14B: each sample also stores its image-condition latent, the VAE's encoding of the clip's
    # first frame followed by zero frames (dfm/data/video_condition.py): one more VAE pass per file.
    wan_image_condition: bool = False

    def resolution_policy(self, multiple: int) -> ResolutionPolicy:
        preset = self.resolution_preset
        if preset is None and self.max_pixels is None and self.height is None and self.width is None:
            preset = "256p"
        return ResolutionPolicy.from_args(multiple, preset, self.max_pixels, self.height, self.width)


class PreparationError(RuntimeError):
    """Stops a preparation: an encoder or device failure on a file, or too many unreadable files."""


class UnreadableInput(Exception):
    """An input file that cannot be read, decoded, captioned or bucketed: skipped and reported."""


@dataclass
class PrepareReport:
    written: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)
    shards: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return f"{self.written} samples written to {len(self.shards)} shards, {len(self.skipped)} files skipped"


@dataclass
class Encoders:
    text: T5TextEncoder
    vae: VideoVAE
    tiny_random: bool
    pooled: CLIPPooledEncoder | None = None  # FLUX: CLIP's pooled caption vector per sample
    hunyuan: HunyuanEncoders | None = None  # HunyuanVideo 1.5: ByT5, first-frame latent and SigLIP parts too


# Text encodings kept for captions seen again (CaptionEncodings): class-labelled or templated datasets repeat a
# few captions many times; 64 MiB holds ~40 captions of 100 T5-xxl tokens, or thousands of short tiny-T5 ones.
CAPTION_CACHE_BYTES = 64 * 2**20


class CaptionEncodings:
    """A caption's text embeddings [L, D] and FLUX's pooled vector [D_pool] (None for other encoder sets),
    computed once while the caption stays among the most recently used ones whose tensors fit in
    ``max_bytes``. Every caption is encoded alone, so a repeated one gets the tensors encoding it again
    would give."""

    def __init__(self, encoders: Encoders, max_bytes: int = CAPTION_CACHE_BYTES) -> None:
        self.encoders, self.max_bytes, self.nbytes = encoders, max_bytes, 0
        self.cache: OrderedDict[str, tuple[torch.Tensor, torch.Tensor | None]] = OrderedDict()

    def __call__(self, caption: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        if caption in self.cache:
            self.cache.move_to_end(caption)
            return self.cache[caption]
        pooled_encoder = self.encoders.pooled
        # Cloned: the encoders return views into their padded batch.
        text = self.encoders.text.encode([caption])[0].clone()
        pooled = pooled_encoder.encode([caption])[0].clone() if pooled_encoder is not None else None
        self.cache[caption] = (text, pooled)
        self.nbytes += tensors_nbytes(text, pooled)
        while self.nbytes > self.max_bytes:
            self.nbytes -= tensors_nbytes(*self.cache.popitem(last=False)[1])
        return text, pooled


def tensors_nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.nbytes for t in tensors if t is not None)


def settings_from_env(settings: PrepareSettings) -> PrepareSettings:
    """Take RANK / WORLD_SIZE from torchrun's environment when present."""
    settings.rank = int(os.environ.get("RANK", settings.rank))
    settings.world_size = int(os.environ.get("WORLD_SIZE", settings.world_size))
    return settings


def tiny_vae_choice(paths: TinyEncoderPaths, settings: PrepareSettings) -> tuple[Path, str]:
    """(folder, kind) of the tiny VAE: FLUX's AutoencoderKL, an AutoencoderKL (--vae_kind kl) or Wan's."""
    if settings.encoders == "flux":
        return paths.flux_vae_dir, "kl"
    if settings.vae_kind == "kl":
        return paths.kl_vae_dir, "kl"
    if settings.vae_kind == "wan22":  # built only when asked for: 48 latent channels
        return build_tiny_wan22_vae(paths.wan_vae_dir.with_name("vae_wan22"), 0), "wan22"
    return paths.wan_vae_dir, "wan"


def load_flux_clip(clip_source: str | Path, vae: VideoVAE, device: str) -> CLIPPooledEncoder:
    """FLUX's CLIP, after checking the VAE is FLUX's kind (an AutoencoderKL)."""
    if vae.kind != "kl":
        raise ValueError(f"--encoders flux needs FLUX's AutoencoderKL; --vae {vae.name} is a {vae.kind!r} VAE")
    return CLIPPooledEncoder.from_pretrained(clip_source, device=device)


def load_hunyuan_encoders(settings: PrepareSettings) -> Encoders:
    """HunyuanVideo 1.5's encoders from its pipeline folder (or tiny random ones)."""
    folder = settings.hunyuan_name_or_dir
    if settings.tiny_random_encoders:
        folder = build_tiny_hunyuan_encoders(
            Path(settings.output_dir) / ".tiny_random_encoders" / f"rank{settings.rank}"
        )
    if folder is None:
        raise ValueError(
            "--encoders hunyuan_video15 needs --hunyuan: a HunyuanVideo 1.5 image-to-video pipeline folder"
        )
    hunyuan = HunyuanEncoders.from_folder(folder, settings.device)
    tiny = is_tiny_random(Path(folder) / "vae")
    return Encoders(HunyuanTextAdapter(hunyuan), HunyuanVAEAdapter(hunyuan), tiny, hunyuan=hunyuan)


def load_encoders(settings: PrepareSettings) -> Encoders:
    if settings.encoders == "hunyuan_video15":
        return load_hunyuan_encoders(settings)
    t5_source, vae_source, subfolder, kind = (
        settings.t5_name_or_dir,
        settings.vae_name_or_dir,
        settings.vae_subfolder,
        settings.vae_kind,
    )
    clip_source = settings.clip_name_or_dir
    if settings.tiny_random_encoders:
        # Per rank, so concurrent ranks never write the same files.
        paths = build_tiny_random_encoders(Path(settings.output_dir) / ".tiny_random_encoders" / f"rank{settings.rank}")
        (vae_source, kind), t5_source, subfolder = tiny_vae_choice(paths, settings), paths.t5_dir, None
        clip_source = paths.clip_dir
    flux = settings.encoders == "flux"
    if flux and clip_source is None:  # before any model loads
        raise ValueError("--encoders flux needs --clip: a CLIP text encoder folder or the FLUX.1 pipeline folder")
    text = T5TextEncoder.from_pretrained_or_cache(
        t5_source, settings.t5_cache_dir, max_length=settings.max_text_len, device=settings.device, full_length=flux
    )
    vae = VideoVAE.from_pretrained_or_cache(
        vae_source, settings.vae_cache_dir, kind=kind, subfolder=subfolder, device=settings.device
    )
    pooled = load_flux_clip(clip_source, vae, settings.device) if flux else None
    tiny = is_tiny_random(t5_source) or is_tiny_random(Path(vae_source) / (subfolder or ""))
    return Encoders(text=text, vae=vae, tiny_random=tiny, pooled=pooled)


def sample_metadata(
    item: MediaItem,
    settings: PrepareSettings,
    encoders: Encoders,
    caption,
    bucket: tuple[int, int],
    latent: torch.Tensor,
    text_len: int,
) -> dict:
    return {
        "caption": caption.text,
        "caption_source": caption.source,
        "source_path": item.path.relative_to(settings.input_dir).as_posix(),
        "media_type": "video" if item.is_video else "image",
        "original_height": item.height,
        "original_width": item.width,
        "bucket_height": bucket[0],
        "bucket_width": bucket[1],
        "num_frames": int(item.frames.shape[0]),
        "source_frames": item.source_frames,
        "frame_stride": settings.frame_stride if item.is_video else 1,
        "fps": item.fps,
        "latent_shape": list(latent.shape),
        "text_len": text_len,
        "t5_encoder": encoders.text.name,
        "vae": encoders.vae.name,
        "vae_kind": encoders.vae.kind,
        "tiny_random_encoders": encoders.tiny_random,
        **({"clip_encoder": encoders.pooled.name} if encoders.pooled is not None else {}),
        **({"first_frame_clean": True} if settings.first_frame_clean else {}),
    }


def image_condition_of(vae: VideoVAE, video: torch.Tensor) -> torch.Tensor:
    """video [1, 3, F, H, W] -> the latent [C, T, H', W'] of its first frame followed by F - 1 zero frames."""
    condition = torch.cat([video[:, :, :1], torch.zeros_like(video[:, :, 1:])], dim=2)
    return vae.encode(condition)[0].float().cpu()


def read_input(
    path: Path, settings: PrepareSettings, encoders: Encoders, captions: CaptionLookup, policy: ResolutionPolicy
) -> tuple[MediaItem, Caption, tuple[int, int]]:
    """(media, caption, bucket) of one file; any failure here is the file's and raises UnreadableInput."""
    try:
        item = read_media(path, settings.num_frames, settings.frame_stride, encoders.vae.temporal_compression)
        return item, captions.caption(path), policy.bucket(item.height, item.width)
    except MemoryError:  # the machine's, not the file's
        raise
    except Exception as error:  # noqa: BLE001 - whatever the decoders raise on a bad file
        raise UnreadableInput(f"{type(error).__name__}: {error}") from error


def encode_file(
    path: Path,
    key: str,
    settings: PrepareSettings,
    encoders: Encoders,
    captions: CaptionLookup,
    policy: ResolutionPolicy,
    caption_encodings: CaptionEncodings,
) -> dict:
    """One media file -> the shard parts of its sample. Raises UnreadableInput (skip the file) or
    PreparationError (an encoder failed: stop, the file is not done)."""
    item, caption, bucket = read_input(path, settings, encoders, captions, policy)
    try:
        video = resize_center_crop(item.frames, *bucket).unsqueeze(0)
        latent = encoders.vae.encode(video)[0].float().cpu()
        text, pooled = caption_encodings(caption.text)
        extra = hunyuan_parts(encoders.hunyuan, video[0], caption.text) if encoders.hunyuan is not None else None
        if settings.wan_image_condition:
            extra = {**(extra or {}), IMAGE_CONDITION_PART: image_condition_of(encoders.vae, video)}
    except Exception as error:
        raise PreparationError(
            f"{path}: encoding failed ({type(error).__name__}: {error}); the file is not marked done: "
            "fix the cause and rerun with --resume (same arguments)"
        ) from error
    metadata = sample_metadata(item, settings, encoders, caption, bucket, latent, int(text.shape[0]))
    return encode_sample_parts(key, latent, text, metadata, pooled, extra)


def log_skipped(report: PrepareReport) -> None:
    if not report.skipped:
        return
    listing = "\n".join(f"  {path}: {reason}" for path, reason in report.skipped)
    logger.warning("skipped %d unreadable files:\n%s", len(report.skipped), listing)


# Settings that do not change which samples are written (may differ on --resume).
RUN_ONLY_SETTINGS = (
    "output_dir",
    "rank",
    "world_size",
    "device",
    "run_energon_prepare",
    "overwrite",
    "resume",
    "max_skip_fraction",
)


def record_args(settings: PrepareSettings, files: list[Path]) -> dict:
    args = {k: v for k, v in asdict(settings).items() if k not in RUN_ONLY_SETTINGS}
    return {**args, "num_files": len(files), "inputs_digest": inputs_digest(files, settings.input_dir)}


def next_shard_number(record: PrepareRecord) -> int:
    return max((int(name.split("-")[-1].split(".")[0]) + 1 for name in record.shards), default=0)


def encode_files(
    todo: list[tuple[int, Path]], key_width: int, settings: PrepareSettings, record: PrepareRecord
) -> None:
    """Encode ``todo`` into new shards; the record lists each shard's files as it is published."""
    out = Path(settings.output_dir)
    encoders = load_encoders(settings)
    policy = settings.resolution_policy(settings.patch_spatial * encoders.vae.spatial_compression)
    captions = CaptionLookup(settings.input_dir, settings.caption_format)
    caption_encodings = CaptionEncodings(encoders)
    in_open_shard: list[int] = []

    def publish(shard_name: str) -> None:
        record.shards[shard_name] = list(in_open_shard)
        in_open_shard.clear()
        record.save(out)

    prefix, start = f"rank{settings.rank:03d}", next_shard_number(record)
    with AtomicShardWriter(out, prefix, settings.shard_maxcount, start, before_publish=publish) as writer:
        for index, path in tqdm(todo, desc=f"prepare rank {settings.rank}", position=settings.rank):
            try:
                key = f"{index:0{key_width}d}"
                parts = encode_file(path, key, settings, encoders, captions, policy, caption_encodings)
            except UnreadableInput as error:
                record.skipped.append((index, str(path), str(error)))
                record.save(out)
                logger.warning("skipping %s: %s", path, error)
                continue
            writer.write(parts)  # may publish the previous shard, whose files are in_open_shard
            in_open_shard.append(index)


def prepare_dataset(settings: PrepareSettings) -> PrepareReport:
    """Encode this rank's share of ``input_dir`` into shards under ``output_dir``."""
    files = find_media_files(settings.input_dir)
    out = Path(settings.output_dir)
    record = open_output_dir(
        out, settings.rank, settings.world_size, record_args(settings, files), settings.overwrite, settings.resume
    )
    key_width = max(8, len(str(len(files))))
    done = record.done_files()
    mine = list(enumerate(files))[settings.rank :: settings.world_size]
    todo = [(i, p) for i, p in mine if i not in done]
    if todo:
        encode_files(todo, key_width, settings, record)
    record.status = COMPLETE
    record.save(out)
    report = PrepareReport(
        written=record.written,
        skipped=[(path, reason) for _, path, reason in record.skipped],
        shards=[str(out / name) for name in sorted(record.shards)],
    )
    log_skipped(report)
    logger.info("rank %d: %s", settings.rank, report.summary())
    report_file = Path(settings.output_dir) / f"prepare_report.rank{settings.rank}.json"
    report_file.write_text(json.dumps(asdict(report), indent=1))
    check_skip_fraction(report, len(mine), settings, report_file)
    if settings.run_energon_prepare:
        if settings.world_size > 1:
            raise ValueError("run energon prepare once after all ranks finish, not with world_size > 1")
        run_energon_prepare(settings.output_dir)
    return report


def check_skip_fraction(report: PrepareReport, num_files: int, settings: PrepareSettings, report_file: Path) -> None:
    """Fail a run that skipped more than ``max_skip_fraction`` of this rank's files."""
    fraction = len(report.skipped) / max(num_files, 1)
    if fraction > settings.max_skip_fraction:
        names = ", ".join(path for path, _ in report.skipped[:5]) + (", ..." if len(report.skipped) > 5 else "")
        raise PreparationError(
            f"rank {settings.rank}: {len(report.skipped)} of {num_files} files skipped ({fraction:.1%} > "
            f"--max_skip_fraction {settings.max_skip_fraction}): {names}; reasons in {report_file}. "
            "Fix them and redo with --overwrite, or accept the loss with --resume --max_skip_fraction <higher>"
        )
