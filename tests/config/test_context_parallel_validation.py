"""Layouts context parallelism cannot run fail at start-up, with a message naming the sizes."""

import pytest

from dfm.config import ConfigError, build_config
from dfm.parallel import ParallelLayout

CP2 = "model.context_parallel_size=2"


@pytest.mark.parametrize(
    "overrides,message",
    [
        # One sample of a pack is cut into 2*cp chunks: 2 tokens cannot be split 4 ways.
        (
            [CP2, "dataset.seq_length=2"],
            r"dataset\.seq_length \(2\) is too short to split.*2 x context_parallel_size \(2\) = 4",
        ),
        (
            [CP2, "dataset.seq_length=18"],
            r"dataset\.seq_length \(18\) is not divisible.*multiple of 2 x context_parallel_size \(2\) = 4",
        ),
        (
            [CP2, "model.tensor_model_parallel_size=2", "model.sequence_parallel=true", "dataset.seq_length=4"],
            r"dataset\.seq_length \(4\) is too short.*2 x context_parallel_size \(2\) x tensor_model_parallel_size \(2\) = 8",
        ),
        (
            ["model.architecture=stdit", "model.num_attention_heads=2", "model.context_parallel_size=4"],
            r"model\.num_attention_heads \(2\) must be divisible by tensor_model_parallel_size \(1\) x "
            r"context_parallel_size \(4\)",
        ),
    ],
)
def test_invalid_context_parallel_layout_is_rejected(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_config("dit_tiny", None, overrides)


def test_valid_context_parallel_layout_is_accepted():
    cfg = build_config("dit_tiny", None, [CP2, "model.tensor_model_parallel_size=2", "model.sequence_parallel=true"])
    assert cfg.model.context_parallel_size == 2


def test_world_not_divisible_by_tp_pp_cp_names_the_sizes():
    with pytest.raises(
        ValueError, match=r"world size 6 is not divisible by tensor \(2\) x pipeline \(1\) x context \(2\)"
    ):
        ParallelLayout(world_size=6, tp=2, cp=2)
