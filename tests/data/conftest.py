"""Shared, session-scoped datasets for the data tests (built once, real shards, real energon prepare)."""

from __future__ import annotations

from pathlib import Path

import pytest
from synthetic_data import synthetic_settings

from dfm.data.prepare.example_dataset import ExampleDataset, build_example_dataset
from dfm.data.prepare.synthetic import write_synthetic_dataset

SYNTHETIC_SAMPLES = 96


@pytest.fixture(scope="session")
def example_dataset(tmp_path_factory) -> ExampleDataset:
    return build_example_dataset(tmp_path_factory.mktemp("example"))


@pytest.fixture(scope="session")
def synthetic_dataset(tmp_path_factory) -> Path:
    return write_synthetic_dataset(tmp_path_factory.mktemp("synthetic"), SYNTHETIC_SAMPLES, synthetic_settings())


@pytest.fixture(scope="session")
def second_synthetic_dataset(tmp_path_factory) -> Path:
    return write_synthetic_dataset(
        tmp_path_factory.mktemp("synthetic2"), 32, synthetic_settings(seed=8), key_prefix="b"
    )
