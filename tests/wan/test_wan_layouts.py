"""dfm's Wan equals diffusers under TP=2 + SP, CP=2 and PP=2 (one launch of 2 gloo processes,
megatron's parallel state re-initialised per layout): the pack of three shapes of the
single-process parity test, two of them Wan 2.2 TI2V samples (per-token timesteps, first frame at 0), each sample against diffusers run alone, outputs <= 1e-5 max abs diff;
under TP=2 + SP and CP=2 also every parameter gradient (each rank's shard, after the reductions
megatron adds) within 1e-4 of diffusers' relative to its max. In the same launch a tiny Wan 2.2
I2V model (``model.wan_image_condition``: each token's mask + image-latent channels read beside its
noisy latent, split with the tokens) at TP=2 + SP and CP=2: outputs and gradients within the same
bounds of diffusers' on each sample alone (as the one-process test_wan22_i2v.py)."""

from pathlib import Path

import pytest

from tests._layouts import GRADIENT_LAYOUTS, LayoutTests, assert_gradients_match, assert_outputs_match


@pytest.mark.slow
class TestWanLayouts(LayoutTests):
    WORKER = Path(__file__).with_name("_layouts_worker.py")
    TOLERANCE = 1e-5
    GRAD_TOLERANCE = 1e-4  # relative; fp32 sums in another order (measured <= 3e-6)

    @pytest.mark.parametrize("layout", GRADIENT_LAYOUTS)
    def test_i2v_layout_matches_diffusers(self, results, layout):
        assert_outputs_match(results, layout, self.TOLERANCE, case="i2v/")
        assert_gradients_match(results, layout, self.GRAD_TOLERANCE, case="i2v/")
