"""Mock data: an infinite, layout-independent stream of DiffusionSamples and packs of them.

Sample ``g`` (the global sample index) is a pure function of ``(settings.seed, g)``.

How global indices reach ranks and micro-batches (``MockPackedLoader``):
- the global stream is cut into global packs, in increasing index order. With ``balance="cost"``
  it is cut into windows of ``window`` samples and each window into packs of about equal cost
  (``dfm.data.pack_selection.cost_balanced_packs``), costliest first. With
  ``balance="tokens"`` greedily: a pack takes the next samples while their real token counts sum
  to at most ``seq_length``. With ``samples_per_pack`` set, a pack is exactly that many next
  samples. A sample longer than ``seq_length`` is skipped;
- data-parallel rank ``r`` of ``n`` trains on global packs ``r, r + n, r + 2n, ...``: its
  micro-batch ``k`` is global pack ``r + k * n``; a global batch is a run of consecutive global
  packs (DP size times the gradient-accumulation steps of them).
Packing decisions use real lengths only, so neither the TP/SP/CP padding nor the DP size
changes which samples share a pack (an MoE load-balancing loss is computed per pack, so the
grouping matters, not only the set of samples). The padded pack may exceed ``seq_length`` by
the layout's padding: ``seq_length`` counts real tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from dfm.data.pack_cost import PackCost
from dfm.data.pack_draws import DrawSettings, with_draws
from dfm.data.pack_selection import PACKING_BALANCES, PackingBalance, cost_balanced_packs
from dfm.data.packed_batch import PackedBatch
from dfm.data.packing import grouped_by_length, pack_samples
from dfm.data.patchify import patchify
from dfm.data.sample import DiffusionSample

logger = logging.getLogger(__name__)

_GOLDEN = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (seed, index) over the seed space


@dataclass
class MockDataSettings:
    seed: int = 1234
    image_sizes: list[tuple[int, int]] = field(default_factory=lambda: [(16, 16), (16, 24), (24, 16)])  # latent [H, W]
    video_sizes: list[tuple[int, int, int]] = field(
        default_factory=lambda: [(4, 16, 16), (2, 16, 24)]
    )  # latent [T, H, W]
    image_fraction: float = 0.5
    text_len_range: tuple[int, int] = (8, 64)  # inclusive
    in_channels: int = 16
    text_embed_dim: int = 64
    patch_temporal: int = 1
    patch_spatial: int = 2
    pooled_text_dim: int | None = None  # set: each pack carries a pooled text vector per sample (FLUX)

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


def mock_pooled_text(settings: MockDataSettings, sample_index: torch.Tensor) -> torch.Tensor:
    """[N] global indices -> [N, pooled_text_dim] pooled text vectors, each a function of (seed, index)."""
    rows = [
        torch.randn(settings.pooled_text_dim, generator=sample_generator(~settings.seed, int(i))) for i in sample_index
    ]
    return torch.stack(rows)


def mock_sample_length(settings: MockDataSettings, index: int) -> int:
    """Token count of global sample ``index`` without drawing its tensors (the shape is drawn first)."""
    _, t, h, w = mock_latent_shape(settings, sample_generator(settings.seed, index))
    return (t // settings.patch_temporal) * (h // settings.patch_spatial) * (w // settings.patch_spatial)


@dataclass(frozen=True)
class MockPacking:
    """How the mock stream is cut into packs (module docstring) and padded for the layout."""

    seq_length: int  # max real tokens per pack; the layout's padding comes on top
    segment_multiple: int = 1  # per-sample padding (2 * CP size with context parallelism)
    total_multiple: int = 1  # whole-pack padding (TP * CP with sequence parallelism)
    samples_per_pack: int | None = None  # set: exactly this many samples a pack
    balance: PackingBalance = "tokens"
    cost: PackCost = field(default_factory=PackCost)  # balance="cost": the model width's cost model
    window: int = 256  # balance="cost": samples a window of cost-balanced packs
    draws: DrawSettings | None = None  # set: each pack carries its samples' training draws (pack_draws.py)

    def __post_init__(self) -> None:
        if self.samples_per_pack is not None and self.samples_per_pack < 1:
            raise ValueError(f"samples_per_pack must be >= 1, got {self.samples_per_pack}")
        if self.balance not in PACKING_BALANCES:
            raise ValueError(f"balance must be one of {PACKING_BALANCES}, got {self.balance!r}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")


class MockPackedLoader:
    """Iterator of PackedBatches for one DP rank (see the module docstring for the index mapping)."""

    def __init__(self, settings: MockDataSettings, dp_rank: int, dp_size: int, packing: MockPacking) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size={dp_size}), got {dp_rank}")
        self.settings = settings
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.packing = packing
        self.next_global_index = 0  # first sample not yet in a pack (or a window)
        self.next_global_pack = 0
        self.window_start = 0  # first sample of the current cost window
        self.window_position = 0  # packs of the current cost window already taken
        self._window_packs: list[list[int]] | None = None  # recomputed from window_start when None
        self.skipped_too_long = 0

    def _fits_alone(self, index: int, length: int) -> bool:
        fits = length <= self.packing.seq_length
        if not fits:
            self.skipped_too_long += 1
            logger.warning(
                "mock sample %d has %d tokens, more than seq_length=%d: skipped (%d skipped so far)",
                index,
                length,
                self.packing.seq_length,
                self.skipped_too_long,
            )
        return fits

    def _next_fitting_sample(self) -> tuple[int, int]:
        """-> (global index, length) of the next sample not longer than seq_length; advances."""
        for _ in range(10_000):
            index = self.next_global_index
            self.next_global_index += 1
            length = mock_sample_length(self.settings, index)
            if self._fits_alone(index, length):
                return index, length
        raise RuntimeError(f"10000 mock samples in a row exceed seq_length={self.packing.seq_length}; raise it")

    def _greedy_pack(self) -> list[int]:
        pack, total = [], 0
        while True:
            start = self.next_global_index
            index, length = self._next_fitting_sample()
            if pack and total + length > self.packing.seq_length:
                # Rewind so the state stays two integers: the sample opens the next pack.
                self.next_global_index = start
                return pack
            pack.append(index)
            total += length

    def _fixed_count_pack(self, count: int) -> list[int]:
        pack = [self._next_fitting_sample() for _ in range(count)]
        if sum(length for _, length in pack) > self.packing.seq_length:
            raise ValueError(
                f"samples {[i for i, _ in pack]} have more than seq_length={self.packing.seq_length} tokens together; "
                f"lower samples_per_pack={count} or raise seq_length"
            )
        return [i for i, _ in pack]

    def _cost_window_packs(self, start: int) -> tuple[list[list[int]], int]:
        """-> (packs of the window starting at ``start``, first index after it)."""
        self.next_global_index = start
        samples = [self._next_fitting_sample() for _ in range(self.packing.window)]
        plan = cost_balanced_packs([n for _, n in samples], self.packing.seq_length, self.packing.cost)
        return [[samples[i][0] for i in pack] for pack in plan.packs], self.next_global_index

    def _cost_balanced_pack(self) -> list[int]:
        if self._window_packs is None:
            self._window_packs, self.next_global_index = self._cost_window_packs(self.window_start)
        if self.window_position == len(self._window_packs):
            self.window_start, self.window_position = self.next_global_index, 0
            self._window_packs, self.next_global_index = self._cost_window_packs(self.window_start)
        self.window_position += 1
        return self._window_packs[self.window_position - 1]

    def _next_global_pack(self) -> list[int]:
        """Global indices of the next global pack (any rank's); advances."""
        self.next_global_pack += 1
        if self.packing.samples_per_pack is not None:
            return self._fixed_count_pack(self.packing.samples_per_pack)
        if self.packing.balance == "cost":
            return self._cost_balanced_pack()
        return self._greedy_pack()

    def next_pack_indices(self) -> list[int]:
        """Global indices of this rank's next pack, passing over the other DP ranks' packs."""
        while self.next_global_pack % self.dp_size != self.dp_rank:
            self._next_global_pack()
        return self._next_global_pack()

    def next_pack_samples(self) -> list[DiffusionSample]:
        return grouped_by_length([mock_sample(self.settings, index) for index in self.next_pack_indices()])

    def __iter__(self) -> Iterator[PackedBatch]:
        return self

    def __next__(self) -> PackedBatch:
        batch = pack_samples(self.next_pack_samples(), self.packing.segment_multiple, self.packing.total_multiple)
        if self.settings.pooled_text_dim is not None:
            batch.pooled_text = mock_pooled_text(self.settings, batch.sample_index)
        return with_draws(batch, self.packing.draws)

    def state_dict(self) -> dict[str, Any]:
        return {
            "next_global_index": self.next_global_index,
            "next_global_pack": self.next_global_pack,
            "window_start": self.window_start,
            "window_position": self.window_position,
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "seed": self.settings.seed,
            "balance": self.packing.balance,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        expected = {
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "seed": self.settings.seed,
            "balance": self.packing.balance,
        }
        state = {"balance": "tokens", "window_start": 0, "window_position": 0, **state}
        for key, value in expected.items():
            if state.get(key) != value:
                raise ValueError(f"mock loader state has {key}={state.get(key)!r}, this loader has {value!r}")
        self.next_global_index = int(state["next_global_index"])
        self.next_global_pack = int(state["next_global_pack"])
        self.window_start = int(state["window_start"])
        self.window_position = int(state["window_position"])
        self._window_packs = None
