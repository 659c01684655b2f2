"""Energon TaskEncoder for diffusion: cook -> encode (patchify) -> pack (by cost or tokens) -> batch.

With packing, energon's micro-batch size is 1: one PackedBatch holds several samples.
Each PackedBatch also carries ``sample_metadata`` (a plain attribute, one dict per sample with
the shard key and the ``.json`` metadata such as the caption) for logging and tests, and
``bad_samples`` ((worker id, bad samples this worker skipped so far)).

A sample that cannot train (``BadSampleError``: missing part, wrong rank, channel count or text
width, non-finite values) stops the run when it is cooked, or with ``skip_bad_samples`` is skipped,
counted and named once in the log.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from megatron.energon import TaskEncoder, WorkerConfig, stateless

from dfm.data.energon.bad_samples import BadSampleLog, DataSettingError
from dfm.data.energon.cooked_cache import CookedSampleCache
from dfm.data.energon.cooker import BadSampleError, CookedDiffusionSample, diffusion_cookers, source_description
from dfm.data.energon.part_decoding import decode_parts
from dfm.data.energon.sample_checks import check_cooked_sample
from dfm.data.pack_cost import PackCost
from dfm.data.pack_draws import DrawSettings, with_draws
from dfm.data.pack_selection import PACKING_BALANCES, PackingBalance, select_packs
from dfm.data.packed_batch import PackedBatch
from dfm.data.packing import grouped_by_length, pack_samples
from dfm.data.patchify import patchify
from dfm.data.sample import DiffusionSample
from dfm.data.video_condition import first_frame_condition, wan_image_condition

logger = logging.getLogger(__name__)


@dataclass
class PackingSettings:
    seq_length: int  # max real tokens per pack; the layout's padding comes on top
    patch_temporal: int = 1
    patch_spatial: int = 2
    max_text_len: int = 512  # longer text embeddings are truncated
    segment_multiple: int = 1  # per-sample padding (2 * CP size with context parallelism)
    total_multiple: int = 1  # whole-pack padding (TP * CP with sequence parallelism)
    balance: PackingBalance = "cost"  # packs of about equal FLOPs, or the fullest packs ("tokens")
    cost: PackCost = PackCost()  # the model width's cost model (PackCost.for_width)
    in_channels: int | None = None  # latent channels the model takes; None: not checked
    text_embed_dim: int | None = None  # text embedding width the model takes; None: not checked
    # Set (FLUX): every sample must carry a pooled text vector this wide, packed into PackedBatch.pooled_text;
    # None: pooled vectors in the shards are ignored.
    pooled_text_dim: int | None = None
    # HunyuanVideo 1.5: every sample must carry the ByT5 text, first-frame latent and image embedding parts.
    image_conditions: bool = False
    draws: DrawSettings | None = None  # set: each pack carries its samples' training draws (pack_draws.py)

    def __post_init__(self) -> None:
        if self.seq_length <= 0:
            raise ValueError(f"seq_length={self.seq_length} must be positive")
        if self.max_text_len <= 0:
            raise ValueError(f"max_text_len must be positive, got {self.max_text_len}")
        if self.balance not in PACKING_BALANCES:
            raise ValueError(f"balance must be one of {PACKING_BALANCES}, got {self.balance!r}")


def sample_metadata(batch: PackedBatch) -> list[dict[str, Any]]:
    """Per-sample metadata attached by DiffusionTaskEncoder ([] for batches built elsewhere)."""
    return list(getattr(batch, "sample_metadata", []))


def image_condition_fields(sample: CookedDiffusionSample) -> dict:
    """DiffusionSample's HunyuanVideo 1.5 fields: the condition is the image-to-video one (the
    training step zeroes it for the samples it trains text-to-video)."""
    parts = {
        "'.byt5.pth'": sample.text_2,
        "'.first_frame.pth'": sample.first_frame,
        "'.image.pth'": sample.image_embeds,
    }
    missing = [name for name, part in parts.items() if part is None]
    if missing:
        where = source_description(sample.__key__, sample.__sources__)
        raise BadSampleError(where, f"no {', '.join(missing)} (HunyuanVideo 1.5 trains on them)")
    condition = first_frame_condition(sample.first_frame, sample.latent.shape[1])
    return dict(condition=patchify(condition, 1, 1)[0], text_2=sample.text_2, image_embeds=sample.image_embeds)


def wan_image_condition_fields(sample: CookedDiffusionSample, settings: PackingSettings) -> dict:
    """DiffusionSample's Wan 2.2 I2V condition tokens when the shard has the image-condition part."""
    condition = sample.image_condition
    if condition is None:
        return {}
    if condition.shape != sample.latent.shape:
        where = source_description(sample.__key__, sample.__sources__)
        raise BadSampleError(
            where,
            f"image-condition latent of shape {tuple(condition.shape)}, the latent's is {tuple(sample.latent.shape)}",
        )
    return {"image_condition": wan_image_condition(condition, settings.patch_temporal, settings.patch_spatial)}


def encode_cooked_sample(
    sample: CookedDiffusionSample, settings: PackingSettings, sample_index: int
) -> tuple[DiffusionSample, bool]:
    """Patchify the latent and cap the text; returns (sample, whether the text was truncated)."""
    tokens, pos_ids = patchify(sample.latent, settings.patch_temporal, settings.patch_spatial)
    text = sample.text_embeddings
    truncated = text.shape[0] > settings.max_text_len
    encoded = DiffusionSample(
        tokens=tokens,
        pos_ids=pos_ids,
        text=text[: settings.max_text_len],
        latent_shape=tuple(int(v) for v in sample.latent.shape),
        sample_index=sample_index,
        metadata={**sample.metadata, "key": sample.__key__},
        pooled_text=sample.pooled_text if settings.pooled_text_dim is not None else None,
        **(image_condition_fields(sample) if settings.image_conditions else {}),
        # Wan 2.2 TI2V: the shard's metadata asks for image-to-video (first frame given clean).
        first_frame_clean=bool(sample.metadata.get("first_frame_clean", False)),
        **wan_image_condition_fields(sample, settings),
    )
    # energon keeps buffered samples restorable through these keys (packing buffer state).
    encoded.__key__ = sample.__key__
    encoded.__restore_key__ = sample.__restore_key__
    return encoded, truncated


# The loaders' limit: more than this fraction of the samples seen (at least TOO_LONG_MIN_SEEN of them)
# longer than dataset.seq_length stops the run (a few longer samples are skipped with a warning).
TOO_LONG_MAX_FRACTION = 0.5
TOO_LONG_MIN_SEEN = 16


class SeqLengthError(DataSettingError):
    """``dataset.seq_length`` does not fit the data: most samples would be dropped."""


class DiffusionTaskEncoder(TaskEncoder[CookedDiffusionSample, DiffusionSample, PackedBatch, PackedBatch]):
    cookers = diffusion_cookers()
    # Parts arrive as raw bytes and are decoded as data by dfm (part_decoding.py): webdataset's
    # default decoders would unpickle '.pickle' and torch.load '.pth' with code execution allowed.
    decoder = None

    def __init__(
        self,
        settings: PackingSettings,
        bad_samples: BadSampleLog | None = None,
        allow_pickle: bool = False,
        max_too_long_fraction: float | None = None,
        cooked_cache_bytes: int = 0,
    ) -> None:
        self.settings = settings
        self.cooked = CookedSampleCache(cooked_cache_bytes)  # per worker process (cooked_cache.py)
        # None: samples longer than seq_length are skipped however many; a fraction: more stops the run
        self.max_too_long_fraction = max_too_long_fraction
        self.allow_pickle = allow_pickle  # dataset.allow_pickle: full pickle for '.pickle' parts (trusted data)
        self.bad_samples = bad_samples if bad_samples is not None else BadSampleLog(skip=False)
        # Diagnostics, per worker process; not part of the loader state.
        self.skipped_too_long = 0
        self.seen_for_packing = 0
        self.longest_skipped = 0
        self.truncated_texts = 0

    @stateless
    def cook_crude_sample(self, sample, cooker, aux) -> CookedDiffusionSample:
        cooked = self.cooked.get(sample)
        if cooked is not None:
            return cooked
        try:
            decoded = decode_parts(sample, self.allow_pickle)
            cooked = super().cook_crude_sample(decoded, cooker, aux)
            s = self.settings
            check_cooked_sample(cooked, s.in_channels, s.text_embed_dim, s.pooled_text_dim)
        except BadSampleError as error:
            self.bad_samples.reject(error)
        self.cooked.put(sample, cooked)
        return cooked

    def global_sample_index(self) -> int:
        """A data-parallel-unique index: energon's per-rank index interleaved over DP ranks.

        energon restores its sample counters on resume, so the index (which seeds the noise)
        is reproduced exactly; it depends on the DP size and num_workers, not on TP/CP/PP.
        """
        config = WorkerConfig.active_worker_config
        return self.current_sample_index * config.world_size + config.rank

    @stateless
    def encode_sample(self, sample: CookedDiffusionSample) -> DiffusionSample:
        encoded, truncated = encode_cooked_sample(sample, self.settings, self.global_sample_index())
        if truncated:
            self.truncated_texts += 1
            logger.warning(
                "key %s: text embedding length %d truncated to max_text_len=%d (%d truncated so far)",
                sample.__key__,
                sample.text_embeddings.shape[0],
                self.settings.max_text_len,
                self.truncated_texts,
            )
        return encoded

    def select_samples_to_pack(self, samples: list[DiffusionSample]) -> list[list[DiffusionSample]]:
        # Real lengths only: the layout's padding never changes which samples share a pack.
        plan = select_packs(
            [s.seq_len_q for s in samples], self.settings.seq_length, self.settings.balance, self.settings.cost
        )
        self.seen_for_packing += len(samples)
        for i in plan.too_long:
            self.skipped_too_long += 1
            self.longest_skipped = max(self.longest_skipped, samples[i].seq_len_q)
            logger.warning(
                "key %s: %d tokens exceed seq_length=%d: sample skipped (%d skipped so far)",
                samples[i].metadata.get("key"),
                samples[i].seq_len_q,
                self.settings.seq_length,
                self.skipped_too_long,
            )
        self.check_too_long_fraction()
        return [[samples[i] for i in pack] for pack in plan.packs]

    def check_too_long_fraction(self) -> None:
        """Most samples longer than ``dataset.seq_length`` is a setting that does not fit the data, not a few
        odd samples: stop naming it (energon would otherwise train on the rest, or on nothing, exit 0)."""
        seen, skipped, limit = self.seen_for_packing, self.skipped_too_long, self.max_too_long_fraction
        if limit is not None and seen >= TOO_LONG_MIN_SEEN and skipped > limit * seen:
            raise SeqLengthError(
                f"dataset.seq_length={self.settings.seq_length} is shorter than most samples: {skipped} of the "
                f"first {seen} samples had more tokens (up to {self.longest_skipped}) and would be dropped. Raise "
                f"dataset.seq_length to at least {self.longest_skipped}, or prepare the data at a smaller size"
            )

    @stateless
    def pack_selected_samples(self, samples: list[DiffusionSample]) -> PackedBatch:
        samples = grouped_by_length(samples)
        batch = pack_samples(samples, self.settings.segment_multiple, self.settings.total_multiple)
        batch.sample_metadata = [s.metadata for s in samples]
        worker = WorkerConfig.active_worker_config  # None outside an energon loader
        batch.bad_samples = (worker.rank_worker_id() if worker is not None else 0, self.bad_samples.count)
        return with_draws(batch, self.settings.draws)  # in the loader's worker, off the training step

    @stateless
    def batch(self, samples: list[PackedBatch]) -> PackedBatch:
        if len(samples) != 1:
            raise ValueError(f"with sequence packing the micro-batch size must be 1, got {len(samples)} packs")
        return samples[0]
