"""Every numeric config field has a declared range, and a value outside it is refused at start-up
(in the config phase, before any process starts) with the key named."""

from __future__ import annotations

import fnmatch
import math
import re

import pytest

from dfm.config.container import ConfigContainer
from dfm.config.errors import ConfigError
from dfm.config.loader import build_config
from dfm.config.ranges import RANGES, Range, check_ranges, numeric_fields, range_of

FIELDS = numeric_fields(ConfigContainer())


def bad_values(allowed: Range, current) -> list:
    """Values just outside ``allowed``, of the field's type."""
    step = 1 if isinstance(current, int) and not isinstance(current, bool) else 0.5
    values = []
    if allowed.low is not None:
        values.append(allowed.low if allowed.low_open else allowed.low - step)
    if allowed.high is not None:
        values.append(allowed.high if allowed.high_open else allowed.high + step)
    if not allowed.optional and current is None:
        values.append(None)
    if step == 0.5:
        values.append(math.nan)
    return values


def test_the_walk_finds_every_section():
    sections = {key.split(".")[0] for key in FIELDS}
    assert sections == {
        "model",
        "train",
        "optimizer",
        "scheduler",
        "dataset",
        "checkpoint",
        "logger",
        "rng",
        "edm",
        "flow",
        "peft",
        "validation",
        "distill",
    }


@pytest.mark.parametrize("key", sorted(FIELDS))
def test_every_numeric_field_has_a_range_and_refuses_values_outside_it(key):
    allowed = range_of(key)
    assert allowed is not None, f"{key}: declare its range in dfm/config/ranges.py"
    assert allowed.problem(FIELDS[key]) is None, f"{key}: its default {FIELDS[key]} is outside its range"
    values = bad_values(allowed, FIELDS[key])
    assert values, f"{key}: a range with no bad value"
    for value in values:
        cfg = ConfigContainer()
        setattr_key(cfg, key, value)  # the type is right: only the range is at fault
        with pytest.raises(ConfigError, match=rf"^{re.escape(key)} must be"):
            check_ranges(cfg)


def setattr_key(cfg: ConfigContainer, key: str, value) -> None:
    section, _, name = key.rpartition(".")
    node = cfg
    for part in section.split("."):
        node = getattr(node, part)
    setattr(node, name, value)


def test_every_declared_range_names_a_field():
    assert [p for p in RANGES if not any(fnmatch.fnmatchcase(key, p) for key in FIELDS)] == []


@pytest.mark.parametrize(
    "override, message",
    [
        ("checkpoint.keep_last=-1", r"checkpoint\.keep_last must be >= 1, got -1 \(or null to leave it unset\)"),
        ("checkpoint.save_interval=0", r"checkpoint\.save_interval must be >= 1, got 0"),
        ("train.global_batch_size=3", r"train\.global_batch_size \(3\) must be a multiple of train\.micro_batch_size"),
        ("dataset.cfg_dropout_prob=1.5", r"dataset\.cfg_dropout_prob must be in \[0, 1\], got 1\.5"),
        ("optimizer.lr=-0.1", r"optimizer\.lr must be >= 0, got -0\.1"),
        ("model.tensor_model_parallel_size=0", r"model\.tensor_model_parallel_size must be >= 1, got 0"),
        ("train.train_iters=0", r"train\.train_iters must be >= 1, got 0"),
        ("peft.target_modules=[]", r"peft\.target_modules is empty with peft\.lora_rank=4"),
    ],
)
def test_overrides_out_of_range_are_refused_before_start(override, message):
    overrides = [override, "train.micro_batch_size=2"] if "global_batch" in override else [override]
    overrides += ["peft.lora_rank=4"] if "peft" in override else []
    with pytest.raises(ConfigError, match=message):
        build_config("dit_tiny", None, overrides)


def test_the_entry_point_names_bad_values_before_start(tmp_path):
    """Through pretrain_dit_model.py: exit non-zero naming the key, no traceback from deep inside."""
    from entry import run_entry

    result = run_entry(1, ["train.train_iters=0", f"logger.log_dir={tmp_path / 'log'}"], timeout=300)
    assert result.returncode != 0
    assert "train.train_iters must be >= 1, got 0" in result.stderr, result.stderr[-2000:]
    assert "AssertionError" not in result.stderr and not (tmp_path / "log").exists()
