"""A sample's training noise, level and text drop depend only on (seed, its global index, unique over a run):
the same in any pack, at any position, beside any other samples (what makes layouts equal one process),
whether the loader drew them (in its worker) or the training step."""

import dataclasses
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
        noise, level, dropped = draw_pack_noise(pipeline, batch, seed=3, cfg_dropout_prob=0.5)
        starts = batch.cu_seqlens_q_padded[:-1].tolist()
        for i, sample in enumerate(members):
            rows = noise[starts[i] : starts[i] + sample.seq_len_q]
            drawn.setdefault(sample.sample_index, []).append((rows, level[i], dropped[i]))
    for index, versions in drawn.items():
        # a fresh generator for the sample draws the same numbers, in the order the docstring names
        generator = torch.Generator().manual_seed(zlib.crc32(f"3:{index}".encode()))
        level = pipeline.levels_from_draws(pipeline.level_draws(1, generator), tokens=[len(versions[0][0])])
        rows = torch.randn(versions[0][0].shape, generator=generator)
        dropped = torch.rand(1, generator=generator) < 0.5
        for got_rows, got_level, got_dropped in versions:
            assert torch.equal(got_rows, rows)
            assert torch.equal(got_level, level[0])
            assert bool(got_dropped) == bool(dropped)


def test_the_loaders_draws_are_the_steps_own(monkeypatch):
    """The mock loader's packs carry their draws (made where the pack is made); the step reads them, and
    draws the same numbers itself for a pack without them."""
    from dfm.config.loader import build_config
    from dfm.diffusion.registry import pipeline_from_config
    from dfm.parallel import ParallelLayout
    from dfm.training.data import build_mock_loader
    from dfm.training.forward_step import DiffusionForwardStep

    monkeypatch.setattr("dfm.training.data.data_parallel_info", lambda: (0, 1))  # one rank, no process group
    cfg = build_config("dit_tiny", None, ["dataset.cfg_dropout_prob=0.5"])
    pack = next(build_mock_loader(cfg, ParallelLayout.from_config(cfg.model, 1)))
    assert pack.noise is not None and pack.draws is not None
    step = DiffusionForwardStep(pipeline_from_config(cfg), cfg.rng.seed, 0.5, torch.device("cpu"))
    bare = dataclasses.replace(pack, noise=None, draws=None)
    for got, expected in zip(step.prepare(pack), step.prepare(bare)):
        if isinstance(got, torch.Tensor):
            assert torch.equal(got, expected)
    prepared = step.prepare(pack)[0]
    assert prepared.noise is None and prepared.draws is None  # the noise goes to the device once, beside it
