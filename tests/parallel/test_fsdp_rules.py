"""Megatron-FSDP's start-up checks (dfm/parallel/rules.py): each refusal names the key to change."""

from __future__ import annotations

import pytest

from dfm.config.errors import ConfigError
from dfm.config.loader import build_config
from tests.parallel.equivalence import FSDP
from tests.training.entry import RECIPE_DIR

MOVIEGEN = str(RECIPE_DIR / "conf" / "moviegen_tiny.yaml")
DIT = str(RECIPE_DIR / "conf" / "dit_tiny.yaml")
WAN = str(RECIPE_DIR / "conf" / "wan_tiny.yaml")


@pytest.mark.parametrize(
    "config,overrides,world,key",
    [
        (DIT, ["ddp.use_torch_fsdp2=true"], 2, "ddp.use_torch_fsdp2"),
        (DIT, ["ddp.data_parallel_sharding_strategy=optim"], 2, "ddp.use_megatron_fsdp=true"),
        (DIT, [*FSDP, "model.pipeline_model_parallel_size=2"], 4, "model.pipeline_model_parallel_size"),
        (DIT, FSDP, 1, "data-parallel x context-parallel size >= 2"),
        (MOVIEGEN, [*FSDP, "model.expert_model_parallel_size=2"], 2, "model.expert_model_parallel_size"),
    ],
)
def test_refused_naming_the_key(config, overrides, world, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build_config(None, config, overrides, world_size=world)


def test_the_tested_layouts_and_the_28b_recipe_are_accepted():
    build_config(None, MOVIEGEN, [*FSDP, "model.expert_model_parallel_size=2", "train.global_batch_size=4"], 4)
    build_config(None, DIT, [*FSDP, "model.tensor_model_parallel_size=2", "model.sequence_parallel=true"], 4)
    build_config(None, WAN, FSDP, 2)  # gradient sharding too (dfm/platform/compat/fsdp.py: forward_through_root_hooks)
    cfg = build_config(None, str(RECIPE_DIR / "conf" / "dit_28b_64k.yaml"), [], world_size=64)
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.ddp.use_megatron_fsdp) == (
        50,
        6144,
        True,
    )  # DiT-28B: NeMo's block at 50 x 6144
