"""The suite passes whatever the clone's folder is called: a clone into ``dfm`` (git's default name for
this repository) puts the tests under ``.../dfm/tests`` and the package under ``.../dfm/dfm``, which
once broke test_step_checks (its call sites were cut at the first ``/dfm/`` in a path).

Mutation checked: test_step_checks.direct_caller cutting at "/dfm/" again (the old code), committed in
a scratch repository cloned by this test: its two [False-False] / [True-True] cases fail, as in the
issue. Takes ~20 s (one pytest of test_step_checks in a fresh process), hence slow."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def git_checkout(root: Path) -> bool:
    if shutil.which("git") is None:
        return False
    probe = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not git_checkout(ROOT), reason="needs git and a git checkout of the repository")
def test_step_checks_pass_in_a_clone_named_dfm(tmp_path):
    clone = tmp_path / "dfm"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
    env.update(PYTHONPATH=str(clone), OMP_NUM_THREADS="1")
    where = subprocess.run(
        [sys.executable, "-c", "import dfm; print(dfm.__file__)"], cwd=clone, env=env, capture_output=True, text=True
    )
    assert Path(where.stdout.strip()).resolve().parent == (clone / "dfm").resolve(), where  # the clone's dfm
    tests = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/training/test_step_checks.py"]
    result = subprocess.run(tests, cwd=clone, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
