"""Mock data: an infinite, layout-independent stream of DiffusionSamples and packs of them.

Sample ``g`` (the global sample index) is a pure function of ``(settings.seed, g)``.

How global indices reach ranks and micro-batches (``MockPackedLoader``):
- data-parallel rank ``r`` of ``n`` owns the global indices ``r, r + n, r + 2n, ...``
  (its j-th local sample is ``g = r + j * n``);
- each rank forms its packs from its own indices, in increasing order, greedily: a pack takes
  the next samples while their padded segments fit in ``seq_length`` (or exactly
  ``samples_per_pack`` samples when that is set);
- micro-batch ``k`` of rank ``r`` is the k-th such pack; a global batch is the set of
  micro-batches with the same ``k`` over all DP ranks (times the gradient-accumulation steps).
TP, CP and PP ranks never enter this mapping, so every rank of one model replica sees the same
packs and the samples of a run depend only on the seed and the DP size.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from dfm.data.packed_batch import PackedBatch
from dfm.data.packing import pack_samples, padded_lengths
from dfm.data.sample import DiffusionSample
from dfm.models.common.patchify import patchify

logger = logging.getLogger(__name__)

_GOLDEN = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (seed, index) over the seed space


@dataclass
class MockDataSettings:
    seed: int = 1234
    image_sizes: list[tuple[int, int]] = field(default_factory=lambda: [(16, 16), (16, 24), (24, 16)])  # latent [H, W]
    video_sizes: list[tuple[int, int, int]] = field(default_factory=lambda: [(4, 16, 16), (2, 16, 24)])  # latent [T, H, W]
    image_fraction: float = 0.5
    text_len_range: tuple[int, int] = (8, 64)  # inclusive
    in_channels: int = 16
    text_embed_dim: int = 64
    patch_temporal: int = 1
    patch_spatial: int = 2

    def __post_init__(self) -> None:
        if not 0.0 <= self.image_fraction <= 1.0:
            raise ValueError(f"image_fraction must be in [0, 1], got {self.image_fraction}")
        if self.image_fraction > 0 and not self.image_sizes:
            raise ValueError("image_fraction > 0 needs at least one entry in image_sizes")
        if self.image_fraction < 1 and not self.video_sizes:
            raise ValueError("image_fraction < 1 needs at least one entry in video_sizes")
        lo, hi = self.text_len_range
        if not 1 <= lo <= hi:
            raise ValueError(f"text_len_range must satisfy 1 <= min <= max, got {self.text_len_range}")


def sample_generator(seed: int, index: int) -> torch.Generator:
    """A CPU generator seeded by (seed, index) only."""
    return torch.Generator().manual_seed((seed * _GOLDEN + index) % (2**63))


def mock_latent_shape(settings: MockDataSettings, gen: torch.Generator) -> tuple[int, int, int, int]:
    is_image = torch.rand((), generator=gen).item() < settings.image_fraction
    if is_image:
        h, w = settings.image_sizes[int(torch.randint(len(settings.image_sizes), (), generator=gen))]
        t = 1
    else:
        t, h, w = settings.video_sizes[int(torch.randint(len(settings.video_sizes), (), generator=gen))]
    return (settings.in_channels, t, h, w)


def mock_latent_and_text(settings: MockDataSettings, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global sample ``index`` -> (latent [C, T, H, W], text embeddings [L, D])."""
    gen = sample_generator(settings.seed, index)
    shape = mock_latent_shape(settings, gen)
    lo, hi = settings.text_len_range
    text_len = int(torch.randint(lo, hi + 1, (), generator=gen))
    latent = torch.randn(shape, generator=gen)
    text = torch.randn((text_len, settings.text_embed_dim), generator=gen)
    return latent, text


def mock_sample(settings: MockDataSettings, index: int) -> DiffusionSample:
    """Global sample ``index``, patchified."""
    latent, text = mock_latent_and_text(settings, index)
    tokens, pos_ids = patchify(latent, settings.patch_temporal, settings.patch_spatial)
    return DiffusionSample(
        tokens=tokens,
        pos_ids=pos_ids,
        text=text,
        latent_shape=tuple(latent.shape),
        sample_index=index,
        metadata={"caption": f"mock sample {index}", "mock": True},
    )


def padded_pack_length(lengths: Sequence[int], segment_multiple: int, total_multiple: int) -> int:
    return sum(padded_lengths(lengths, segment_multiple, total_multiple)) if lengths else 0


class MockPackedLoader:
    """Iterator of PackedBatches for one DP rank (see the module docstring for the index mapping)."""

    def __init__(
        self,
        settings: MockDataSettings,
        dp_rank: int,
        dp_size: int,
        seq_length: int,
        segment_multiple: int = 1,
        total_multiple: int = 1,
        samples_per_pack: Optional[int] = None,
    ) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size={dp_size}), got {dp_rank}")
        if seq_length % total_multiple != 0:
            raise ValueError(f"seq_length={seq_length} must be a multiple of total_multiple={total_multiple}")
        if samples_per_pack is not None and samples_per_pack < 1:
            raise ValueError(f"samples_per_pack must be >= 1, got {samples_per_pack}")
        self.settings = settings
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seq_length = seq_length
        self.segment_multiple = segment_multiple
        self.total_multiple = total_multiple
        self.samples_per_pack = samples_per_pack
        self.next_local_index = 0
        self.skipped_too_long = 0

    def global_index(self, local_index: int) -> int:
        return self.dp_rank + local_index * self.dp_size

    def _take_sample(self) -> DiffusionSample:
        sample = mock_sample(self.settings, self.global_index(self.next_local_index))
        self.next_local_index += 1
        return sample

    def _fits_alone(self, sample: DiffusionSample) -> bool:
        fits = padded_pack_length([sample.seq_len_q], self.segment_multiple, self.total_multiple) <= self.seq_length
        if not fits:
            self.skipped_too_long += 1
            logger.warning(
                "mock sample %d has %d tokens, more than seq_length=%d: skipped (%d skipped so far)",
                sample.sample_index, sample.seq_len_q, self.seq_length, self.skipped_too_long,
            )
        return fits

    def _next_fitting_sample(self) -> DiffusionSample:
        for _ in range(10_000):
            sample = self._take_sample()
            if self._fits_alone(sample):
                return sample
        raise RuntimeError(f"10000 mock samples in a row exceed seq_length={self.seq_length}; raise it")

    def _greedy_pack(self) -> list[DiffusionSample]:
        pack: list[DiffusionSample] = []
        while True:
            start = self.next_local_index
            sample = self._next_fitting_sample()
            lengths = [s.seq_len_q for s in pack] + [sample.seq_len_q]
            if pack and padded_pack_length(lengths, self.segment_multiple, self.total_multiple) > self.seq_length:
                # Rewind so the state stays one integer: the sample opens the next pack.
                self.next_local_index = start
                return pack
            pack.append(sample)

    def _fixed_count_pack(self, count: int) -> list[DiffusionSample]:
        pack = [self._next_fitting_sample() for _ in range(count)]
        length = padded_pack_length([s.seq_len_q for s in pack], self.segment_multiple, self.total_multiple)
        if length > self.seq_length:
            raise ValueError(
                f"samples {[s.sample_index for s in pack]} pad to {length} tokens, more than seq_length="
                f"{self.seq_length}; lower samples_per_pack={count} or raise seq_length"
            )
        return pack

    def next_pack_samples(self) -> list[DiffusionSample]:
        if self.samples_per_pack is not None:
            return self._fixed_count_pack(self.samples_per_pack)
        return self._greedy_pack()

    def __iter__(self) -> Iterator[PackedBatch]:
        return self

    def __next__(self) -> PackedBatch:
        return pack_samples(self.next_pack_samples(), self.segment_multiple, self.total_multiple)

    def state_dict(self) -> dict[str, Any]:
        return {"next_local_index": self.next_local_index, "dp_rank": self.dp_rank, "dp_size": self.dp_size,
                "seed": self.settings.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        expected = {"dp_rank": self.dp_rank, "dp_size": self.dp_size, "seed": self.settings.seed}
        for key, value in expected.items():
            if state.get(key) != value:
                raise ValueError(f"mock loader state has {key}={state.get(key)!r}, this loader has {value!r}")
        self.next_local_index = int(state["next_local_index"])

