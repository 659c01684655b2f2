"""A sample's training noise, level and text drop depend only on (seed, iteration, its global index):
the same in any pack, at any position, beside any other samples (what makes layouts equal one process)."""

import zlib

import pytest
import torch

from dfm.data.packing import pack_samples
from dfm.diffusion.registry import build_pipeline
from dfm.training.forward_step import draw_pack_noise
from tests.models._helpers import make_samples, tiny_config


@pytest.mark.parametrize("kind", ["flow", "edm"])
def test_a_samples_draws_do_not_depend_on_its_pack(kind):
    pipeline = build_pipeline(kind)
    samples = make_samples(tiny_config("dit_cross"))
    packs = {"all": samples, "reversed": samples[::-1], "alone": samples[2:3]}
    drawn = {}
    for members in packs.values():
        batch = pack_samples(members, segment_multiple=8)
        noise, level, dropped = draw_pack_noise(pipeline, batch, seed=3, iteration=7, cfg_dropout_prob=0.5)
        starts = batch.cu_seqlens_q_padded[:-1].tolist()
        for i, sample in enumerate(members):
            rows = noise[starts[i] : starts[i] + sample.seq_len_q]
            drawn.setdefault(sample.sample_index, []).append((rows, level[i], dropped[i]))
    for index, versions in drawn.items():
        # a fresh generator for the sample draws the same numbers, in the order the docstring names
        generator = torch.Generator().manual_seed(zlib.crc32(f"3:7:{index}".encode()))
        level = pipeline.levels_from_draws(pipeline.level_draws(1, generator), tokens=[len(versions[0][0])])
        rows = torch.randn(versions[0][0].shape, generator=generator)
        dropped = torch.rand(1, generator=generator) < 0.5
        for got_rows, got_level, got_dropped in versions:
            assert torch.equal(got_rows, rows)
            assert torch.equal(got_level, level[0])
            assert bool(got_dropped) == bool(dropped)
