"""Writing samples to webdataset ``.tar`` shards in the DFM-compatible layout, never half-written.

Per sample: ``<key>.pth`` (torch.save of the latent [C, T, H, W]), ``<key>.pickle`` (pickled float32
numpy T5 embeddings [L, D]), ``<key>.json`` (metadata) and, for FLUX, ``<key>.pooled.pth``
(torch.save of CLIP's pooled text vector [D_pool]). A shard is written as ``*.tar.partial``
and renamed to ``*.tar`` once closed; on an error the partial file is deleted.
"""

from __future__ import annotations

import io
import json
import pickle
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import webdataset as wds

PARTIAL_SUFFIX = ".partial"
POOLED_PART = "pooled.pth"  # decoded by its extension, like the latent
# HunyuanVideo 1.5's extra parts: ByT5 text [L2, D2] (L2 may be 0), the first frame's latent [C, 1, H, W]
# and its SigLIP image embedding [L_img, D_img].
BYT5_PART, FIRST_FRAME_PART, IMAGE_PART = "byt5.pth", "first_frame.pth", "image.pth"
HUNYUAN_PARTS = (BYT5_PART, FIRST_FRAME_PART, IMAGE_PART)
# Wan 2.2 I2V-A14B: the VAE's normalised latent [C, T, H, W] of the clip's [first frame, zero frames ...]
# (dfm/data/video_condition.py), encoded once here; the mask is added when the sample is loaded.
IMAGE_CONDITION_PART = "image_condition.pth"


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor.detach().cpu().contiguous(), buffer)
    return buffer.getvalue()


def encode_sample_parts(
    key: str,
    latent: torch.Tensor,
    text: torch.Tensor,
    metadata: dict[str, Any],
    pooled: torch.Tensor | None = None,
    extra: dict[str, torch.Tensor] | None = None,
) -> dict:
    """``extra``: more tensor parts by name (HunyuanVideo 1.5's ``HUNYUAN_PARTS``, ``IMAGE_CONDITION_PART``)."""
    if latent.dim() != 4:
        raise ValueError(f"sample {key}: latent must be [C, T, H, W], got {tuple(latent.shape)}")
    if text.dim() != 2:
        raise ValueError(f"sample {key}: text embeddings must be [L, D], got {tuple(text.shape)}")
    if pooled is not None and pooled.dim() != 1:
        raise ValueError(f"sample {key}: the pooled text vector must be [D], got {tuple(pooled.shape)}")
    parts = {
        "__key__": key,
        "pth": tensor_bytes(latent),
        "pickle": pickle.dumps(text.detach().float().cpu().numpy()),
        "json": json.dumps(metadata).encode("utf-8"),
    }
    if pooled is not None:
        parts[POOLED_PART] = tensor_bytes(pooled.float())
    for name, tensor in (extra or {}).items():
        parts[name] = tensor_bytes(tensor.float())
    return parts


class AtomicShardWriter:
    """Context manager over webdataset's ShardWriter: shards appear in ``out_dir`` only when complete."""

    def __init__(
        self,
        out_dir: str | Path,
        prefix: str,
        maxcount: int,
        start_shard: int = 0,
        before_publish: Callable[[str], None] | None = None,
    ) -> None:
        """``before_publish(shard file name)`` runs when a shard is complete, before it appears."""
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.pattern = str(self.out_dir / f"{prefix}-%06d.tar{PARTIAL_SUFFIX}")
        self.maxcount = maxcount
        self.start_shard = start_shard
        self.before_publish = before_publish
        self.finished: list[Path] = []
        self.writer: wds.ShardWriter | None = None

    def _publish(self, partial_name: str) -> None:
        final = Path(partial_name[: -len(PARTIAL_SUFFIX)])
        if self.before_publish is not None:
            self.before_publish(final.name)
        Path(partial_name).rename(final)
        self.finished.append(final)

    def write(self, sample: dict) -> None:
        if self.writer is None:
            # Opened lazily: ShardWriter opens a file on construction, which would leave an empty shard.
            # A whole-second mtime: a fractional one gives every member a pax header, which the loader then
            # parses on every read (two header blocks per part instead of one).
            self.writer = wds.ShardWriter(
                self.pattern,
                maxcount=self.maxcount,
                post=self._publish,
                start_shard=self.start_shard,
                verbose=0,
                mtime=int(time.time()),
            )
        self.writer.write(sample)

    def __enter__(self) -> AtomicShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.writer is None:
            return
        if exc_type is None:
            self.writer.close()
            return
        partial = self.writer.fname
        self.writer.post = None
        self.writer.close()
        if partial is not None:
            Path(partial).unlink(missing_ok=True)


def prepared_encoders(dataset_dir: str | Path) -> dict[str, Any] | None:
    """The encoders a dfm-prepared dataset was made with, as its first sample's metadata records them:
    ``{"t5": ..., "vae": ..., "vae_kind": ...}``; None for anything else (a metadataset yaml, no shards,
    samples without the record)."""
    shards = sorted(Path(dataset_dir).glob("*.tar")) if Path(dataset_dir).is_dir() else []
    if not shards:
        return None
    with tarfile.open(shards[0]) as tar:
        member = next((m for m in tar if m.isfile() and m.name.endswith(".json")), None)
        metadata = json.loads(tar.extractfile(member).read()) if member is not None else {}
    if "t5_encoder" not in metadata or "vae" not in metadata:
        return None
    return {"t5": metadata["t5_encoder"], "vae": metadata["vae"], "vae_kind": metadata.get("vae_kind", "auto")}
