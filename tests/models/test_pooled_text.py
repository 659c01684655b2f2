"""``model.pooled_text``: each sample's mean text feature joins its timestep conditioning."""

import dataclasses

import pytest
import torch

from dfm.data.packing import pack_samples
from dfm.models.build import build_model_chunk
from dfm.models.dit.dit_model import pooled_text
from tests.models._helpers import conditioning, make_samples, randomize_, tiny_config


def test_pooled_text_is_each_samples_mean_over_its_real_text():
    cfg = tiny_config("moviegen")
    samples = make_samples(cfg)
    pack = pack_samples(samples, total_multiple=16)  # pads the last text segment
    assert pack.context.shape[0] > sum(s.text.shape[0] for s in samples)
    expected = torch.stack([s.text.mean(dim=0) for s in samples])
    torch.testing.assert_close(pooled_text(pack), expected)
    null = dataclasses.replace(pack, context=torch.zeros_like(pack.context))
    assert torch.count_nonzero(pooled_text(null)) == 0


@pytest.mark.parametrize("name", ["moviegen", "stdit", "dit_cross"])
def test_pooled_text_conditions_each_sample_on_its_own_caption(dist, name):
    cfg = tiny_config(name, pooled_text=True)
    model, _ = build_model_chunk(cfg, "fp32", seed=3)
    randomize_(model)
    pack = pack_samples(make_samples(cfg))
    c_noise, _ = conditioning(pack.num_samples)
    cond = model.conditioning(c_noise, None, pack)
    # A new caption for sample 1 only: its conditioning changes, the others' do not.
    start, end = pack.cu_seqlens_kv[1:3].tolist()
    context = pack.context.clone()
    context[start:end] += 1.0
    recaptioned = model.conditioning(c_noise, None, dataclasses.replace(pack, context=context))
    changed = (recaptioned - cond).abs().amax(dim=1) > 0
    assert changed.tolist() == [False, True, False, False]
    without = dataclasses.replace(cfg, pooled_text=False)
    plain, _ = build_model_chunk(without, "fp32", seed=3)
    assert "pooled_text_embedder.mlp.0.weight" in dict(model.named_parameters())
    assert not any("pooled_text" in n for n, _ in plain.named_parameters())
