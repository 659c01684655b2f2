"""Presets: published shapes, usable as recipes, built on the meta device with exact counts."""

import pytest

from dfm.config.container import ModelConfig
from dfm.config.presets import PRESETS
from dfm.config.recipes import get_recipe
from dfm.models.presets_cli import main, preset_parameter_counts

# facebookresearch/DiT README: DiT-XL/2 has 675M parameters (675,129,632 counted with its
# frozen 256 x 1152 sin-cos pos_embed parameter, which we compute on the fly instead).
DIT_XL2_PUBLISHED = 675_129_632


def test_dit_xl2_has_the_published_parameter_count():
    count = preset_parameter_counts(["DiT-XL/2"])["DiT-XL/2"]
    assert abs(count / DIT_XL2_PUBLISHED - 1) < 0.01
    assert count == DIT_XL2_PUBLISHED - 256 * 1152  # exact, up to the frozen pos_embed


def test_presets_are_recipes_with_their_published_shapes():
    shapes = {
        name: (PRESETS[name]["num_layers"], PRESETS[name]["hidden_size"], PRESETS[name]["num_attention_heads"])
        for name in PRESETS
    }
    assert shapes["DiT-XL/2"] == (28, 1152, 16) and shapes["DiT-S/2"] == (12, 384, 6)
    assert shapes["DiT-7B"] == (28, 4096, 32) and shapes["DiT-28B"] == (50, 6144, 48)
    assert shapes["DiT-12B"] == (32, 4096, 32) and shapes["DiT-40B"] == (48, 6144, 48)
    assert shapes["MovieGen-30B"] == (48, 6144, 48) and PRESETS["MovieGen-30B"]["ffn_hidden_size"] == 16384
    for name in PRESETS:
        assert get_recipe(name).model == ModelConfig(**PRESETS[name])


# NeMo's DiT7BConfig: 28 x 4096, 32 heads, 1024-wide text context, RMSNorm, no linear biases, per-head
# q/k norm; a low-rank (256) adaLN is what brings it to 7B (full adaLN: 9.7B).
NEMO_DIT_7B = dict(
    num_layers=28,
    hidden_size=4096,
    num_attention_heads=32,
    cross_attention_dim=1024,
    normalization="rmsnorm",
    add_bias_linear=False,
    qk_layernorm=True,
    adaln_lora_dim=256,
)


def test_dit_presets_are_the_size_their_names_state():
    names = ["DiT-7B", "DiT-28B", "DiT-12B", "DiT-40B"]
    counts = preset_parameter_counts(names)
    for name in names:
        stated = float(name.split("-")[1].rstrip("B")) * 1e9
        assert abs(counts[name] / stated - 1) < 0.03, f"{name}: {counts[name]:,d} parameters"
    assert {key: PRESETS["DiT-7B"][key] for key in NEMO_DIT_7B} == NEMO_DIT_7B
    assert counts["DiT-7B"] == 7_074_935_872 and counts["DiT-28B"] == 27_726_500_416


@pytest.mark.slow
def test_cli_builds_every_preset_on_meta(capsys):
    main(["--all"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[0] for line in lines] == list(PRESETS)
    counts = {line.split()[0]: int(line.split()[2].replace(",", "")) for line in lines}
    assert counts["DiT-XL/2"] == DIT_XL2_PUBLISHED - 256 * 1152
    assert 25e9 < counts["STDiT-30B"] < 35e9


def test_cli_rejects_unknown_preset():
    with pytest.raises(SystemExit):
        main(["--preset", "DiT-XXL/2"])
