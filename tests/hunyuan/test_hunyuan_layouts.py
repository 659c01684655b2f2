"""dfm's HunyuanVideo 1.5 equals diffusers under TP=2 + SP, CP=2 and PP=2 (one launch of 2 gloo
processes, megatron's parallel state re-initialised per layout): the mixed t2v / i2v pack of the
single-process test, each sample against diffusers run alone, outputs <= 1e-5 max abs diff; under
TP=2 + SP and CP=2 also every parameter gradient (each rank's shard, after the reductions megatron
adds) within 1e-5 of diffusers' (relative to max(1, its max))."""

from pathlib import Path

import pytest

from tests._layouts import LayoutTests


@pytest.mark.slow
class TestHunyuanLayouts(LayoutTests):
    WORKER = Path(__file__).with_name("_layouts_worker.py")
    TOLERANCE = 1e-5
    GRAD_TOLERANCE = 1e-5
