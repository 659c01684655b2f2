"""The digit classifier as a validation metric: ``digit_accuracy`` is the fraction of decoded validation
samples classified as the digit their prompt names (prompts are ``digit_caption``s).

    python -m digits.validation_metric --config-file conf/digits_tiny.yaml dataset.path=... \\
        train.eval_interval=100 'validation.prompts=["a handwritten digit zero", ...]' \\
        'validation.metrics=[digit_accuracy]'

registers it (dfm.training.sample_metrics.register) and runs the pretrain entry point with the rest of
the arguments (docs/learning.md, "Validation during training").
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np

from digits.data import DIGIT_MAX, DIGIT_WORDS
from digits.evaluate import digit_classifier


def prompted_digit(prompt: str) -> int:
    """The digit a ``digit_caption`` names ("a handwritten digit seven" -> 7); refused otherwise."""
    word = prompt.split()[-1] if prompt.split() else ""
    if word not in DIGIT_WORDS:
        raise ValueError(f"validation prompt {prompt!r} names no digit (digit_accuracy needs digit captions)")
    return DIGIT_WORDS.index(word)


def digit_accuracy(samples: Sequence) -> dict[str, float]:
    """Samples (``.prompt``, ``.frames`` [T, 8, 8, 3] uint8) -> {"accuracy": fraction classified as prompted},
    each sample's first frame, its channels averaged, on the classifier's 0..16 scale."""
    pixels = np.stack([s.frames[0].astype(np.float64).mean(-1) * DIGIT_MAX / 255 for s in samples])
    labels = np.array([prompted_digit(s.prompt) for s in samples])
    return {"accuracy": digit_classifier(centred=False).accuracy(pixels, labels)}


def main(argv: list[str]) -> None:
    from pretrain_dit_model import main as pretrain_main

    from dfm.training.sample_metrics import register

    register("digit_accuracy", digit_accuracy)
    pretrain_main(argv)


if __name__ == "__main__":  # dist_checkpointing starts worker processes: keep this guard
    main(sys.argv[1:])
