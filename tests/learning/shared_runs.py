"""Runs that two learning test files both need, made once per test run.

test_digits_learn.py trains and scores a flow model on the digits; test_digits_distill.py needs the same
model (the same config, data and seed) as its teacher. Under pytest-xdist the two files may run in different
workers: the run is made in a folder both workers see, under a file lock, by whichever asks first; the other
waits for it and reads it back. Its figures are the ones either file would have made alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from digits.evaluate import DigitSampling
from digits.run import CI_CONFIG, PipelineRun, prepare_digits, read_losses, train_and_score

# conf/digits_tiny.yaml's flow model as both files score it: 10 samples per caption, 12 Euler steps, guidance 3.
CI_SAMPLING = DigitSampling(samples_per_caption=10, steps=12, guidance_scale=3.0, seed=0)
DONE = ".done"


def shared_folder(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """``name`` under this test run's base folder, the same for every xdist worker (a worker's own base
    folder is a child of the run's)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    folder = base / "shared" / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextlib.contextmanager
def held(lock: Path) -> Iterator[None]:
    """An exclusive lock on the file ``lock``, across processes."""
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def digits_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits prepared once (encoders and energon dataset) in the shared folder."""
    root = shared_folder(tmp_path_factory, "digits")
    with held(root / "prepare.lock"):
        prepare_digits(root)
    return root


def flow_run(root: Path) -> PipelineRun:
    """conf/digits_tiny.yaml as flow matching, trained into ``root/flow`` and scored, or read back."""
    out = root / "flow"
    with held(root / "flow.lock"):
        if not (out / DONE).is_file():
            run = train_and_score(root, "flow", CI_CONFIG, ["model.pipeline=flow"], CI_SAMPLING)
            (out / DONE).write_text(f"{run.seconds}\n")
            return run
    scores = json.loads((out / "scores.json").read_text())
    return PipelineRun(read_losses(out), scores, float((out / DONE).read_text()))
