"""The random numbers a pack's samples are trained with, drawn where the pack is made.

Per sample: its noise level's numbers (``level_kinds``: "normal" or "uniform" each, what the pipeline's
``levels_from_draws`` reads), its noise rows and its text-drop number, in that order, from a generator
seeded with crc32("seed:index"), ``index`` the sample's global index in the data stream. That index is
unique over a run (a counter over DP ranks and loader workers that resume restores), so a sample's draws
depend on neither the pack nor the layout that reaches it, nor on the step. The loaders attach them to
each pack (in their worker processes, off the training step's path); the training step draws the same
numbers itself for a pack made elsewhere.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from dfm.data.packed_batch import PackedBatch

# ``level_kinds``' names -> the in-place draws (``empty(n)`` filled: randn's and rand's numbers)
DRAW_INTO: dict[str, Callable[..., Tensor]] = {"normal": Tensor.normal_, "uniform": Tensor.uniform_}


@dataclass(frozen=True)
class DrawSettings:
    """``seed``: the run's (``rng.seed``); ``level_kinds``: the pipeline's ``level_draw_kinds()``."""

    seed: int
    level_kinds: tuple[str, ...]


def sample_seeds(seed: int, sample_index: list[int]) -> list[int]:
    """crc32("seed:index") of each sample: the CRC of the common prefix continued by each index."""
    crc = zlib.crc32(f"{seed}:".encode())
    return [zlib.crc32(str(index).encode(), crc) for index in sample_index]


def draw_pack(batch: PackedBatch, settings: DrawSettings) -> tuple[Tensor, Tensor]:
    """-> (noise [S, D] fp32, zero on padding; numbers [N, len(level_kinds) + 1]: each sample's level
    numbers, then its text-drop number), on the CPU.

    The loop only draws, into views made for the whole pack beforehand: the same numbers as ``randn`` /
    ``rand`` of one sample's sizes from its generator."""
    host = batch.host_view()
    lengths = host.sample_lengths.tolist()
    padded = host.padded_sample_lengths.tolist()
    noise = torch.zeros(batch.latents.shape, dtype=torch.float32)
    rows = [room if n == room_n else room[:n] for room, n, room_n in zip(noise.split(padded), lengths, padded)]
    fills = [DRAW_INTO[kind] for kind in settings.level_kinds]
    width = len(fills) + 1
    numbers = torch.empty(len(lengths), width)
    cells = numbers.view(-1).unbind()  # one view per number, made at once
    level_cells = list(zip(*(cells[k::width] for k in range(width - 1)))) or [()] * len(lengths)
    reused = torch.Generator()  # reseeding resets all of a generator's state: the draws of a new one
    for sample_seed, row, own, drop in zip(
        sample_seeds(settings.seed, host.sample_index.tolist()), rows, level_cells, cells[width - 1 :: width]
    ):
        generator = reused.manual_seed(sample_seed)
        for fill, cell in zip(fills, own):
            fill(cell, generator=generator)
        row.normal_(generator=generator)
        drop.uniform_(generator=generator)
    return noise, numbers


def with_draws(batch: PackedBatch, settings: DrawSettings | None) -> PackedBatch:
    """``batch`` holding its draws (``settings`` None: as it is)."""
    if settings is not None:
        batch.noise, batch.draws = draw_pack(batch, settings)
    return batch
