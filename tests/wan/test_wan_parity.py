"""dfm's Wan equals diffusers' WanTransformer3DModel (the oracle), one process, fp32: a pack of
three samples of different (T, H, W) and text lengths against diffusers run on each sample alone
(its text zero-padded to model.max_text_len as WanPipeline pads it): outputs <= 1e-5 max abs
diff, and the parameter gradients of one backward (mapped to diffusers names by the rules)."""

import pytest

from dfm.convert.wan import parity_samples, parity_timesteps
from dfm.data.packing import pack_samples
from tests.wan._tiny import diffusers_reference, parity_errors, tiny_wan_pair

FORWARD_TOLERANCE = 1e-5
GRAD_TOLERANCE = 1e-4  # relative to each gradient's max: fp32 sums in another order (measured <= 5.5e-5)


@pytest.fixture(scope="module")
def errors(dist):
    """(output diff, {diffusers name: relative gradient diff}) of a pack of three samples vs diffusers on
    each alone, one backward of sum_i <out_i, g_i> (random g_i) on both sides."""
    transformer, model, cfg = tiny_wan_pair()
    samples = parity_samples(cfg)
    batch, timesteps = pack_samples(samples, segment_multiple=4), parity_timesteps(len(samples))
    return parity_errors(model, cfg, batch, timesteps, diffusers_reference(transformer, samples, timesteps))


def test_forward_matches_diffusers_per_sample(errors):
    assert errors[0] <= FORWARD_TOLERANCE


def test_gradients_match_diffusers(errors):
    assert all(error <= GRAD_TOLERANCE for error in errors[1].values()), errors[1]
