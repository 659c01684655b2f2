"""The tight reference: dense batches hold exactly each pack's samples, and it builds every block dfm's
DiT family benchmarks against (DiT, MovieGen-style)."""

from unittest import mock

import pytest
import torch

from benchmarks.ladders import get_ladder
from benchmarks.reference_dit import ReferenceDiT, batches_from_pack
from benchmarks.run_benchmarks import rung_config
from dfm.data.packed_batch import segment_lengths
from dfm.parallel import ParallelLayout
from dfm.training.data import build_mock_loader


def first_pack(name: str):
    cfg = rung_config(next(r for r in get_ladder("cpu") if r.name == name), [])
    with mock.patch("dfm.training.data.data_parallel_info", return_value=(0, 1)):  # one process, no group
        return cfg, next(build_mock_loader(cfg, ParallelLayout.from_config(cfg.model, 1)))


def test_dense_batches_hold_each_sample_once_with_its_caption():
    cfg, pack = first_pack("tiny-256-mix")
    starts, lengths = pack.cu_seqlens_q_padded[:-1].tolist(), segment_lengths(pack.cu_seqlens_q).tolist()
    text_starts, text_lengths = pack.cu_seqlens_kv_padded[:-1].tolist(), segment_lengths(pack.cu_seqlens_kv).tolist()
    samples = {
        (pack.latents[s : s + n].numpy().tobytes(), pack.context[t : t + m].numpy().tobytes())
        for s, n, t, m in zip(starts, lengths, text_starts, text_lengths)
    }
    seen = set()
    for batch in batches_from_pack(pack):
        mask = (
            torch.ones(batch.text.shape[:2], dtype=torch.bool) if batch.text_mask is None else batch.text_mask[:, 0, 0]
        )
        assert torch.all(batch.text[~mask] == 0)
        for row in range(batch.latents.shape[0]):
            seen.add((batch.latents[row].numpy().tobytes(), batch.text[row, mask[row]].numpy().tobytes()))
    assert seen == samples and sum(b.latents.shape[0] for b in batches_from_pack(pack)) == pack.num_samples


@pytest.mark.parametrize("rung", ["digits-video", "digits-video-moviegen", "tiny-256-mix"])
def test_reference_follows_the_block_and_trains(rung):
    cfg, pack = first_pack(rung)
    model = ReferenceDiT(cfg.model)
    block = model.blocks[0]
    moviegen = cfg.model.architecture == "moviegen"
    assert isinstance(block.norm1, torch.nn.RMSNorm) == moviegen
    assert (block.mlp.fc1.out_features == 2 * cfg.model.effective_ffn_hidden_size) == moviegen
    assert isinstance(block.attn.q_norm, torch.nn.RMSNorm) == cfg.model.qk_layernorm
    batch = batches_from_pack(pack)[0]
    out = model(batch.latents, torch.rand(batch.latents.shape[0]), batch.pos_ids, batch.text, batch.text_mask)
    assert out.shape == batch.latents.shape
    out.square().mean().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
