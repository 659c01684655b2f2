"""A rank's pieces of a tensor as sharded tensors (``dfm.checkpoint.pieces``): the boxes of a flat
range cover it exactly, and through dist_checkpointing (one process) pieces read back from a tensor
written whole, a whole tensor from pieces, and FLUX's strided TP shards land at their global places.
(Resume across layouts with pieces: tests/parallel/test_fsdp_resume.py, tests/training/test_checkpoint_resume.py.)
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from dfm.checkpoint.pieces import Piece, flat_range_boxes
from dfm.models.flux.strided import strided_factory
from dfm.platform.distributed import destroy_distributed, initialize_distributed


@given(shape=st.lists(st.integers(1, 5), min_size=0, max_size=4), data=st.data())
def test_boxes_cover_the_flat_range_once_each_contiguous(shape, data):
    numel = math.prod(shape)
    start = data.draw(st.integers(0, numel))
    stop = data.draw(st.integers(start, numel))
    index = torch.arange(numel).reshape(shape)
    covered = []
    for first, box in flat_range_boxes(tuple(shape), start, stop):
        part = index[tuple(slice(lo, hi) for lo, hi in box)].reshape(-1)
        assert part.tolist() == list(range(first, first + part.numel()))  # contiguous, starting at first
        covered += part.tolist()
    assert covered == list(range(start, stop))
    assert len(flat_range_boxes(tuple(shape), start, stop)) <= max(2 * len(shape) - 1, 1)


@pytest.fixture
def one_process():
    initialize_distributed(seed=0)
    yield
    destroy_distributed()


def whole(key: str, tensor: torch.Tensor) -> ShardedTensor:
    return ShardedTensor.from_rank_offsets(key, tensor)


def save(state: dict, directory) -> None:
    directory.mkdir()
    dist_checkpointing.save(state, str(directory))


def test_pieces_read_from_a_whole_tensor_and_back(tmp_path, one_process):
    full = torch.randn(6, 5, 4)
    save({"w": whole("w", full)}, tmp_path / "whole")
    template = whole("w", torch.empty(6, 5, 4))
    pieces = [Piece(template, (6, 5, 4), start, stop - start, 0) for start, stop in ((0, 7), (7, 61), (61, 120))]
    flats = [torch.zeros(p.numel) for p in pieces]
    request = {str(i): p.sharded("w", flat) for i, (p, flat) in enumerate(zip(pieces, flats))}
    loaded = dist_checkpointing.load(request, str(tmp_path / "whole"))
    for i, (piece, flat) in enumerate(zip(pieces, flats)):
        piece.fill(flat, loaded[str(i)])
    assert torch.equal(torch.cat(flats), full.reshape(-1))

    state = {str(i): p.sharded("w", flat) for i, (p, flat) in enumerate(zip(pieces, flats))}
    save(state, tmp_path / "pieces")
    back = dist_checkpointing.load({"w": whole("w", torch.zeros(6, 5, 4))}, str(tmp_path / "pieces"))
    assert torch.equal(back["w"], full)


def test_strided_shards_land_at_their_global_places(tmp_path, one_process):
    """A TP rank's strided shard (2 chunks along dim 1, as FLUX's proj_out) written in pieces reads
    back as the same factory reads it."""
    local = torch.randn(3, 8)
    template = strided_factory(ShardedTensor.from_rank_offsets("p", torch.empty(3, 8), (1, 0, 1)), dim=1, stride=2)
    pieces = [Piece(template, (3, 8), start, stop - start, 0) for start, stop in ((0, 5), (5, 24))]
    state = {str(i): p.sharded("p", local.reshape(-1)[p.start : p.start + p.numel]) for i, p in enumerate(pieces)}
    save(state, tmp_path / "ckpt")
    request = strided_factory(ShardedTensor.from_rank_offsets("p", torch.zeros(3, 8), (1, 0, 1)), dim=1, stride=2)
    assert torch.equal(dist_checkpointing.load({"p": request}, str(tmp_path / "ckpt"))["p"], local)


def test_pieces_share_the_rank_memory_so_a_save_copies_nothing():
    """megatron's writer copies a host tensor whose storage is larger than itself (any view): the
    pieces of a parameter buffer must own exactly their bytes while sharing the buffer's memory."""
    buffer = torch.randn(100)
    flat = buffer[10:70]  # a rank's range of a parameter inside its bucket
    template = whole("w", torch.empty(6, 10))
    sharded = Piece(template, (6, 10), 3, 60 - 3, 0).sharded("w", flat[3:])
    assert len(sharded) == 2  # the rest of row 0, rows 1-5
    for part in sharded:
        assert part.data.untyped_storage().nbytes() == part.data.numel() * part.data.element_size()
    assert sharded[0].data.data_ptr() == flat[3:].data_ptr()
    flat.zero_()
    assert all(not part.data.any() for part in sharded)
