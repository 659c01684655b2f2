"""It learns: scikit-learn's 8x8 digits -> captioned image folder -> the real preparation
(tiny random T5, normalising identity VAE) -> energon prepare -> the real pretrain entry point on CPU
(dit_cross, EDM and flow matching side by side) -> generation with classifier-free guidance from every
caption -> a classifier trained on the real digits.

CI-sized (conf/digits_tiny.yaml); the longer run and the measured figures are in docs/learning.md.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pytest
from digits.classifier import train_digit_classifier
from digits.data import digit_caption, load_digits, to_uint8
from digits.run import CI_CONFIG, train_and_score
from digits.validation_metric import digit_accuracy
from shared_runs import CI_SAMPLING, digits_root, flow_run

from dfm.config.loader import build_config

PIPELINES = ("edm", "flow")
CHANCE = 0.1
CONDITIONAL_THRESHOLD = 0.6  # the bar for the CI-sized run; measured figures in docs/learning.md
UNCONDITIONAL_CEILING = 0.3  # null text, no guidance: near chance (0.1), with room for 100 samples' noise


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """EDM and flow side by side (a single-threaded child each); the flow run is test_digits_distill.py's
    teacher too, made once per test run (shared_runs.py)."""
    root = digits_root(tmp_path_factory)
    with ThreadPoolExecutor(len(PIPELINES)) as pool:
        edm = pool.submit(train_and_score, root, "edm", CI_CONFIG, ["model.pipeline=edm"], CI_SAMPLING)
        flow = pool.submit(flow_run, root)
        return {"edm": edm.result(), "flow": flow.result()}


def test_classifier_recognises_real_digits():
    assert train_digit_classifier().held_out_accuracy >= 0.95


@dataclass
class Sample:  # what validation hands a metric (dfm.training.validation_media.DecodedSample)
    prompt: str
    frames: np.ndarray  # [T, H, W, 3] uint8


def test_digit_accuracy_metric_reads_decoded_samples_and_their_prompts():
    """Real digits as decoded frames: accuracy near 1 under their own captions, near 0 under the next digit's."""
    images, labels = load_digits()
    frames = np.repeat(to_uint8(images[:200])[:, None, :, :, None], 3, axis=-1)  # [N, 1, 8, 8, 3]
    right = [Sample(digit_caption(int(d)), f) for d, f in zip(labels[:200], frames)]
    wrong = [Sample(digit_caption((int(d) + 1) % 10), f) for d, f in zip(labels[:200], frames)]
    assert digit_accuracy(right)["accuracy"] >= 0.95
    assert digit_accuracy(wrong)["accuracy"] <= 0.05
    with pytest.raises(ValueError, match="names no digit"):
        digit_accuracy([Sample("a cat", frames[0])])


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", PIPELINES)
def test_dit_cross_learns_digits(runs, pipeline):
    scores = runs[pipeline].scores[-1]
    print(
        f"{pipeline}: conditional accuracy: {scores['conditional_accuracy']:.2f}, "
        f"unconditional accuracy: {scores['unconditional_accuracy']:.2f}"
    )
    assert scores["iteration"] == build_config(None, str(CI_CONFIG)).train.train_iters
    assert scores["conditional_accuracy"] >= CONDITIONAL_THRESHOLD > 5 * CHANCE
    assert scores["unconditional_accuracy"] <= UNCONDITIONAL_CEILING
