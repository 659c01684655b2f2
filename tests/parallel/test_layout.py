"""ParallelLayout: every rule refuses naming the key to change, every proven layout builds, and
what follows from the sizes (dp, padding, megatron's kwargs, the checkpoint fingerprint)."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest

from dfm.config import ConfigError, ModelConfig, build_config
from dfm.parallel import ParallelLayout
from tests.parallel.equivalence import world_size
from tests.parallel.test_layout_equivalence import CASES
from tests.training.entry import RECIPE_DIR

DFM = Path(__file__).resolve().parents[2] / "dfm"
MOVIEGEN = str(RECIPE_DIR / "conf" / "moviegen_tiny.yaml")
TP2 = "model.tensor_model_parallel_size=2"


@pytest.mark.parametrize(
    "sizes, message",
    [
        (dict(tp=0), r"model\.tensor_model_parallel_size must be >= 1, got 0"),
        (dict(world_size=2, pp=2, vpp=0), r"model\.virtual_pipeline_model_parallel_size must be >= 1 or null, got 0"),
        (
            dict(world_size=6, tp=2, cp=2),
            r"world size 6 is not divisible by tensor \(2\) x pipeline \(1\) x context \(2\) parallel sizes = 4: "
            r"launch a multiple of 4 ranks .* change model\.tensor_model_parallel_size, "
            r"model\.pipeline_model_parallel_size or model\.context_parallel_size",
        ),
        (
            dict(world_size=4, tp=2, ep=4),
            r"model\.expert_model_parallel_size 4 must divide data-parallel size 2 x context-parallel size 1",
        ),
        (
            dict(vpp=2),
            r"model\.virtual_pipeline_model_parallel_size=2 needs model\.pipeline_model_parallel_size >= 2, got 1",
        ),
        (dict(sp=True), r"model\.sequence_parallel=true .* needs model\.tensor_model_parallel_size >= 2, got 1"),
    ],
)
def test_invalid_layout_cannot_be_built(sizes, message):
    with pytest.raises(ConfigError, match=message):
        ParallelLayout(**sizes)


@pytest.mark.parametrize(
    "config_file, overrides, message",
    [
        (
            None,
            ["model.pipeline_model_parallel_size=2", "model.virtual_pipeline_model_parallel_size=2"],
            r"model\.num_layers \(2\) must be a multiple of the pipeline stages: pipeline_model_parallel_size \(2\) "
            r"x virtual_pipeline_model_parallel_size \(2\) = 4",
        ),
        (
            None,
            ["model.num_attention_heads=1", TP2],
            r"model\.num_attention_heads \(1\) must be divisible by model\.tensor_model_parallel_size \(2\)",
        ),
        (
            None,
            ["model.ffn_hidden_size=101", TP2],
            r"model\.ffn_hidden_size \(101\) must be divisible by model\.tensor_model_parallel_size \(2\)",
        ),
        (
            MOVIEGEN,
            ["model.moe_ffn_hidden_size=101", TP2, "model.sequence_parallel=true"],
            r"model\.moe_ffn_hidden_size \(101\) must be divisible by model\.tensor_model_parallel_size \(2\)",
        ),
        (
            MOVIEGEN,
            [TP2],
            r"model\.num_moe_experts \(4\) with model\.tensor_model_parallel_size \(2\) needs "
            r"model\.sequence_parallel=true",
        ),
        (
            MOVIEGEN,
            ["model.expert_model_parallel_size=3"],
            r"model\.num_moe_experts \(4\) must be divisible by model\.expert_model_parallel_size \(3\)",
        ),
        (
            None,
            ["model.expert_model_parallel_size=2"],
            r"model\.expert_model_parallel_size \(2\) needs an MoE model: set model\.num_moe_experts",
        ),
    ],
)
def test_model_that_cannot_run_under_the_layout_is_refused(config_file, overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_config("dit_tiny", config_file, overrides)


def test_world_rules_apply_once_the_world_is_known():
    build_config("dit_tiny", None, [TP2])  # outside a launch: any world the sizes tile
    build_config("dit_tiny", None, [TP2], world_size=4)
    for world in (1, 3):
        with pytest.raises(ConfigError, match=rf"world size {world} is not divisible by tensor \(2\)"):
            build_config("dit_tiny", None, [TP2], world_size=world)


@pytest.mark.parametrize("config, layout, reference", CASES, ids=lambda v: v if isinstance(v, str) else None)
def test_every_proven_layout_is_accepted(config, layout, reference):
    cfg = build_config(None, str(RECIPE_DIR / "conf" / f"{config}.yaml"), layout, world_size=world_size(layout))
    assert ParallelLayout.from_config(cfg.model, world_size(layout)).world_size == world_size(layout)


def test_dp_is_the_ranks_the_model_parallel_ones_leave():
    layout = ParallelLayout(world_size=16, tp=2, pp=2, cp=2, ep=4)
    assert (layout.model_parallel, layout.dp) == (8, 2)
    assert ParallelLayout(world_size=3).dp == 3


def test_unknown_world_is_the_smallest_the_sizes_tile():
    model = ModelConfig(tensor_model_parallel_size=2, context_parallel_size=2, expert_model_parallel_size=4)
    layout = ParallelLayout.from_config(model, None)
    assert (layout.world_size, layout.dp) == (8, 2)  # ep=4 needs dp x cp = 4


@pytest.mark.parametrize(
    "sizes, multiples",
    [(dict(), (1, 1)), (dict(tp=2), (1, 1)), (dict(tp=2, sp=True), (1, 2)), (dict(cp=2), (4, 4))]
    + [(dict(tp=2, sp=True, cp=2), (4, 8))],
)
def test_padding_multiples(sizes, multiples):
    layout = ParallelLayout(world_size=sizes.get("tp", 1) * sizes.get("cp", 1), **sizes)
    assert layout.padding_multiples() == multiples


def test_fingerprint_names_every_size():
    layout = ParallelLayout(world_size=16, tp=2, pp=2, vpp=2, ep=2)
    assert layout.fingerprint() == {"world": 16, "tp": 2, "pp": 2, "dp": 4, "cp": 1, "ep": 2, "vpp": 2}
    assert ParallelLayout().fingerprint()["vpp"] == 1


def test_megatron_kwargs_are_megatrons_names():
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = ParallelLayout(world_size=8, tp=2, pp=2, vpp=2, ep=2).megatron_parallel_kwargs()
    assert kwargs == {
        "tensor_model_parallel_size": 2,
        "pipeline_model_parallel_size": 2,
        "virtual_pipeline_model_parallel_size": 2,
        "context_parallel_size": 1,
        "expert_model_parallel_size": 2,
    }
    assert set(kwargs) <= set(inspect.signature(parallel_state.initialize_model_parallel).parameters)
    assert set(kwargs) <= {f.name for f in dataclasses.fields(TransformerConfig)}


def test_config_values_round_trip():
    layout = ParallelLayout(world_size=8, tp=2, pp=2, vpp=2, sp=True, ep=2)
    model = dataclasses.replace(ModelConfig(), **layout.config_values())
    assert ParallelLayout.from_config(model, 8) == layout


SIZE_NAMES = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
)


def test_sizes_are_named_in_the_config_and_the_layout_only():
    naming = {
        str(path.relative_to(DFM)) for path in DFM.rglob("*.py") if any(name in path.read_text() for name in SIZE_NAMES)
    }
    assert naming <= {"config/container.py", "parallel/layout.py"}, naming


def test_global_batch_must_split_over_micro_batches_and_data_parallel_ranks():
    build_config("dit_tiny", None, ["train.global_batch_size=4", "train.micro_batch_size=1"], world_size=4)
    with pytest.raises(ConfigError, match=r"train\.global_batch_size \(6\) must be a multiple of .* = 4"):
        build_config("dit_tiny", None, ["train.global_batch_size=6", "train.micro_batch_size=1"], world_size=4)
