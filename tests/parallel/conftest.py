"""One single-process reference run per (config, overrides), shared by every layout case of the session."""

from __future__ import annotations

import pytest

from tests.parallel.equivalence import Run, train


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory):
    tmp, cache = tmp_path_factory.mktemp("reference"), {}

    def reference(config: str, overrides: list[str]) -> Run:
        key = (config, tuple(overrides))
        if key not in cache:
            cache[key] = train(tmp, config, 1, overrides)
        return cache[key]

    return reference
