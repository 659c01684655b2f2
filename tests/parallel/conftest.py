"""The session's training runs, shared by every layout case (tests/parallel/equivalence.py: LayoutRuns)."""

from __future__ import annotations

import pytest

from tests.parallel.equivalence import LayoutRuns


@pytest.fixture(scope="session")
def layout_runs(tmp_path_factory) -> LayoutRuns:
    return LayoutRuns(tmp_path_factory.mktemp("layout_runs"))
