"""A Slurm that is installed but does not start skips its tests on a workstation and fails them in CI."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("slurm_conftest", Path(__file__).with_name("conftest.py"))
slurm_conftest = sys.modules.setdefault("slurm_conftest", importlib.util.module_from_spec(spec))
spec.loader.exec_module(slurm_conftest)


@pytest.mark.parametrize(("ci", "outcome"), [("true", pytest.fail.Exception), ("", pytest.skip.Exception)])
def test_a_start_failure_fails_under_ci(monkeypatch, ci, outcome):
    monkeypatch.setenv("CI", ci)
    with pytest.raises(outcome, match="could not start Slurm: slurmd exited 1"):
        slurm_conftest.start_failed("could not start Slurm: slurmd exited 1")
