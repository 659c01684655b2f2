"""dfm's Wan equals diffusers under TP=2 + SP, CP=2 and PP=2 (one launch of 2 gloo processes,
megatron's parallel state re-initialised per layout): the pack of three shapes of the
single-process parity test, two of them Wan 2.2 TI2V samples (per-token timesteps, first frame at 0), each sample against diffusers run alone, outputs <= 1e-5 max abs diff;
under TP=2 + SP and CP=2 also every parameter gradient (each rank's shard, after the reductions
megatron adds) within 1e-4 of diffusers' relative to its max."""

from pathlib import Path

from tests._layouts import LayoutTests


class TestWanLayouts(LayoutTests):
    WORKER = Path(__file__).with_name("_layouts_worker.py")
    TOLERANCE = 1e-5
    GRAD_TOLERANCE = 1e-4  # relative; fp32 sums in another order (measured <= 3e-6)
