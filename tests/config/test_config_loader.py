"""Config system: recipes, YAML files, Hydra-grammar overrides, error messages, CLI."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dfm.config import (
    ConfigContainer,
    ConfigError,
    build_config,
    config_to_dict,
    format_config,
    get_recipe,
    load_config_from_cli,
    parse_args,
    recipe_names,
    save_config_yaml,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


# --- recipes -------------------------------------------------------------------------------


def test_dit_recipe_is_the_documented_defaults():
    cfg = get_recipe("dit")
    assert cfg == ConfigContainer()
    assert (cfg.model.architecture, cfg.model.num_layers, cfg.model.hidden_size) == ("dit_cross", 12, 384)
    assert cfg.model.ffn_hidden_size is None and cfg.model.effective_ffn_hidden_size == 4 * 384
    assert cfg.model.max_latent_thw == [32, 128, 128]
    assert cfg.train.global_batch_size is None and cfg.train.train_iters == 20
    assert cfg.optimizer.lr == 1e-4 and cfg.optimizer.adam_eps == 1e-8
    assert cfg.scheduler.decay_iters(cfg.train.train_iters) == 20
    assert cfg.dataset.mock_image_sizes == [[16, 16], [32, 32], [16, 32]]
    assert cfg.dataset.mock_video_sizes == [[4, 16, 16], [8, 16, 16]]
    assert cfg.mixed_precision.precision == "fp32" and cfg.rng.seed == 1234


def test_dit_tiny_recipe():
    cfg = get_recipe("dit_tiny")
    model = cfg.model
    assert (model.num_layers, model.hidden_size, model.num_attention_heads) == (2, 64, 4)
    assert (model.in_channels, model.text_embed_dim, model.max_text_len) == (4, 32, 32)
    assert cfg.dataset.seq_length == 256 and cfg.optimizer.lr == 1e-3 and cfg.train.train_iters == 20


def test_recipes_return_fresh_objects():
    first = get_recipe("dit_tiny")
    first.dataset.mock_image_sizes.append([4, 4])
    assert get_recipe("dit_tiny").dataset.mock_image_sizes == [[8, 8], [8, 16]]


def test_every_recipe_builds_and_validates():
    for name in recipe_names():
        # A two-expert recipe (Wan 2.2 A14B) needs the expert the run trains.
        two_experts = get_recipe(name).model.wan_boundary_ratio is not None
        assert isinstance(
            build_config(name, None, ["model.wan_expert=low_noise"] if two_experts else []), ConfigContainer
        )


def test_unknown_recipe_lists_valid_names_and_suggests():
    with pytest.raises(ConfigError, match=r"unknown recipe 'dit_tiy'; did you mean 'dit_tiny'\?.*dit, dit_tiny"):
        get_recipe("dit_tiy")


# --- layering ------------------------------------------------------------------------------


def test_no_recipe_and_no_file_gives_defaults():
    assert build_config(None, None, []) == ConfigContainer()


def test_file_overrides_recipe_and_picks_base_recipe(tmp_path):
    path = write(
        tmp_path,
        """
        recipe: dit_tiny
        train:
          train_iters: 7
        optimizer:
          lr: 3e-4          # YAML 1.1 would read this as a string
          weight_decay: 0   # int is fine for a float field
        dataset:
          mock_image_sizes: [[4, 4]]
        checkpoint:
          save: /tmp/ckpt
        logger:
    """,
    )
    cfg = build_config(None, path, [])
    assert cfg.model.hidden_size == 64  # from dit_tiny
    assert cfg.train.train_iters == 7
    assert cfg.optimizer.lr == 3e-4 and isinstance(cfg.optimizer.weight_decay, float)
    assert cfg.dataset.mock_image_sizes == [[4, 4]]
    assert cfg.checkpoint.save == "/tmp/ckpt"


def test_explicit_recipe_wins_over_file_recipe(tmp_path):
    path = write(tmp_path, "recipe: dit_tiny\n")
    assert build_config("dit", path, []).model.hidden_size == 384


def test_cli_overrides_win_over_file(tmp_path):
    path = write(tmp_path, "train:\n  train_iters: 7\n  micro_batch_size: 3\n")
    cfg = build_config("dit_tiny", path, ["train.train_iters=20000", "model.num_layers=32"])
    assert cfg.train.train_iters == 20000 and cfg.train.micro_batch_size == 3
    assert cfg.model.num_layers == 32


def test_empty_file_is_no_overrides(tmp_path):
    assert build_config("dit_tiny", write(tmp_path, ""), []) == get_recipe("dit_tiny")


# --- Hydra override grammar ----------------------------------------------------------------


def test_hydra_values_lists_null_bools_strings_floats():
    cfg = build_config(
        "dit_tiny",
        None,
        [
            "dataset.mock_image_sizes=[[8,8],[16,16]]",
            "dataset.packing_buffer_size=null",
            "model.qk_layernorm=true",
            "train.exit_signal_handler=False",
            "model.pos_embedding=learned3d",
            "logger.wandb_exp_name='my run'",
            "logger.wandb_project=2024",
            "optimizer.lr=1e-3",
            "optimizer.clip_grad=0",
            "optimizer.ema_decay=0.9999",
            "model.num_classes=1000",
        ],
    )
    assert cfg.dataset.mock_image_sizes == [[8, 8], [16, 16]]
    assert cfg.dataset.packing_buffer_size is None
    assert cfg.model.qk_layernorm is True and cfg.train.exit_signal_handler is False
    assert cfg.model.pos_embedding == "learned3d"
    assert cfg.logger.wandb_exp_name == "my run" and cfg.logger.wandb_project == "2024"
    assert cfg.optimizer.lr == 1e-3 and cfg.optimizer.clip_grad == 0.0 and isinstance(cfg.optimizer.clip_grad, float)
    assert cfg.optimizer.ema_decay == 0.9999 and cfg.model.num_classes == 1000


def test_whole_section_override_with_a_mapping():
    cfg = build_config("dit_tiny", None, ["train={train_iters: 3, micro_batch_size: 2}"])
    assert (cfg.train.train_iters, cfg.train.micro_batch_size) == (3, 2)


# --- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.train_itres=5", r"unknown config key 'train\.train_itres'; did you mean 'train\.train_iters'\?"),
        ("train.lr=1", r"unknown config key 'train\.lr'; did you mean 'optimizer\.lr'\?"),
        (
            "trian.train_iters=3",
            r"unknown config key 'trian\.train_iters' \(no section 'trian'\); "
            r"did you mean 'train\.train_iters'\?",
        ),
        ("train.train_iters=abc", r"config key 'train\.train_iters' expects int, got str 'abc'"),
        ("train.train_iters=[1,2]", r"config key 'train\.train_iters' expects int, got list"),
        ("train.train_iters=1.5", r"config key 'train\.train_iters' expects int, got float"),
        ("train.train_iters=true", r"config key 'train\.train_iters' expects int, got bool"),
        ("train.train_iters=null", r"config key 'train\.train_iters' expects int, got null"),
        ("model.qk_layernorm=1", r"config key 'model\.qk_layernorm' expects bool"),
        ("dataset.mock_image_sizes=[[8,x]]", r"config key 'dataset\.mock_image_sizes\[0\]\[1\]' expects int"),
        ("model.pipeline=ddpm", r"config key 'model\.pipeline' expects one of 'edm', 'flow'"),
        ("train=3", r"config key 'train' is a section and expects a mapping"),
        ("train.train_iters.x=3", r"config key 'train\.train_iters' is a value, not a section"),
        ("train.train_iters", r"malformed override 'train\.train_iters'"),
        ("train.train_iters=[1,", r"malformed override"),
        ("+train.new_key=3", r"only plain 'key=value'"),
        ("~train.train_iters", r"only plain 'key=value'"),
        ("train.train_iters=1,2", r"sweeps are not supported"),
        (
            "model.pipeline_model_parallel_size=4",
            r"model\.num_layers \(2\) must be a multiple of the pipeline "
            r"stages: pipeline_model_parallel_size \(4\) x virtual_pipeline_model_parallel_size \(1\) = 4",
        ),
        ("mixed_precision.fp8=e5m2", r"config key 'mixed_precision\.fp8' expects one of 'e4m3', 'hybrid'"),
        ("optimizer.ema_decay=1.0", r"optimizer\.ema_decay must be in \(0, 1\), got 1\.0"),
    ],
)
def test_override_errors_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        build_config("dit_tiny", None, [override])


def test_override_error_names_the_override():
    with pytest.raises(ConfigError, match=r"\(in override 'train\.train_itres=5'\)"):
        build_config("dit_tiny", None, ["train.train_itres=5"])


def test_unknown_key_in_file_names_key_file_and_suggestion(tmp_path):
    path = write(tmp_path, "model:\n  num_layer: 3\n")
    with pytest.raises(ConfigError) as info:
        build_config(None, path, [])
    text = str(info.value)
    assert "unknown config key 'model.num_layer'; did you mean 'model.num_layers'?" in text
    assert path in text


def test_unknown_section_in_file(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'optimiser'; did you mean 'optimizer'\?"):
        build_config(None, write(tmp_path, "optimiser:\n  lr: 1.0\n"), [])


def test_wrong_type_in_file(tmp_path):
    path = write(tmp_path, "dataset:\n  mock_video_sizes: 5\n")
    with pytest.raises(
        ConfigError, match=r"config key 'dataset\.mock_video_sizes' expects list\[list\[int\]\], got int"
    ):
        build_config(None, path, [])


def test_section_that_is_not_a_mapping_in_file(tmp_path):
    with pytest.raises(ConfigError, match=r"config key 'train' is a section and expects a mapping"):
        build_config(None, write(tmp_path, "train: 5\n"), [])


def test_file_that_is_not_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match=r"must hold a mapping of sections, got list"):
        build_config(None, write(tmp_path, "- 1\n- 2\n"), [])


def test_bad_yaml_names_the_file(tmp_path):
    path = write(tmp_path, "train:\n  train_iters: [1, 2\n")
    with pytest.raises(ConfigError, match=r"cannot read config file") as info:
        build_config(None, path, [])
    assert path in str(info.value)


def test_missing_file_names_the_path(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match=r"config file not found") as info:
        build_config("dit", missing, [])
    assert missing in str(info.value)


def test_unknown_recipe_in_file(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown recipe 'dti'"):
        build_config(None, write(tmp_path, "recipe: dti\n"), [])


def test_non_string_recipe_in_file(tmp_path):
    with pytest.raises(ConfigError, match=r"config key 'recipe'"):
        build_config(None, write(tmp_path, "recipe: [dit]\n"), [])


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.num_attention_heads=5", r"model\.hidden_size \(64\) must be divisible by model\.num_attention_heads"),
        ("dataset.mock_video_sizes=[[8,8]]", r"dataset\.mock_video_sizes entries must be 3 positive ints"),
        ("dataset.mock_text_len_range=[9,3]", r"low <= high"),
        ("dataset.mock_text_len_range=[4,64]", r"exceeds model\.max_text_len"),
        ("dataset.cfg_dropout_prob=1.5", r"dataset\.cfg_dropout_prob must be in \[0, 1\]"),
        ("train.micro_batch_size=0", r"train\.micro_batch_size must be >= 1"),
    ],
)
def test_cross_field_validation(override, message):
    with pytest.raises(ConfigError, match=message):
        build_config("dit_tiny", None, [override])


# --- save / format -------------------------------------------------------------------------


def test_save_then_load_round_trips(tmp_path):
    cfg = build_config(
        "dit_tiny",
        None,
        [
            "optimizer.adam_eps=1e-12",
            "checkpoint.save=/tmp/x",
            "dataset.mock_image_sizes=[[8,8],[16,16]]",
            "model.recompute_granularity=full",
            "logger.wandb_exp_name='007'",
        ],
    )
    path = save_config_yaml(cfg, tmp_path / "nested" / "resolved.yaml")
    assert build_config(None, str(path), []) == cfg
    assert config_to_dict(cfg)["optimizer"]["adam_eps"] == 1e-12


def test_format_config_is_readable_yaml():
    text = format_config(get_recipe("dit_tiny"))
    assert "train:\n  train_iters: 20\n" in text
    assert "mock_text_len_range: [4, 16]" in text


# --- CLI -----------------------------------------------------------------------------------


def test_parse_args_splits_options_and_overrides():
    args = parse_args(["--recipe", "dit_tiny", "train.train_iters=3", "--mock", "--config-file=a.yaml", "a.b=[1,2]"])
    assert (args.recipe, args.config_file, args.mock) == ("dit_tiny", "a.yaml", True)
    assert args.overrides == ["train.train_iters=3", "a.b=[1,2]"]


@pytest.mark.parametrize("argv", [["train.train_iters"], ["--unknown-flag"], ["--conf", "x.yaml"]])
def test_parse_args_rejects_non_overrides(argv):
    with pytest.raises(ConfigError, match=r"unrecognized argument"):
        parse_args(argv)


def test_load_config_from_cli(tmp_path):
    path = write(tmp_path, "recipe: dit_tiny\ntrain:\n  train_iters: 7\n")
    cfg, args = load_config_from_cli(["--config-file", path, "--mock", "train.train_iters=9"])
    assert cfg.train.train_iters == 9 and cfg.model.hidden_size == 64 and args.mock


def test_config_or_exit_exits_2_with_message_on_stderr():
    script = (
        "from dfm.config import config_or_exit\n"
        "config_or_exit(['--recipe', 'dit_tiny', 'train.train_itres=5'])\n"
        "print('unreachable')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "train.train_iters" in result.stderr and "unreachable" not in result.stdout


def test_warm_up_longer_than_the_run_is_refused_naming_both_keys():
    with pytest.raises(
        ConfigError, match=r"scheduler\.lr_warmup_iters \(20\) must be less than train\.train_iters \(20\)"
    ):
        build_config("dit_tiny", None, ["train.train_iters=20", "scheduler.lr_warmup_iters=20"])


def test_explicit_keys_are_the_file_and_override_keys_not_the_recipe(tmp_path):
    """What checkpoint.pretrained may not replace: keys the config file or the overrides set."""
    config = tmp_path / "run.yaml"
    config.write_text("recipe: dit_tiny\nmodel:\n  hidden_size: 64\ntrain:\n  train_iters: 5\n")
    args = parse_args(["--config-file", str(config), "model.num_layers=3", "optimizer.lr=0.1"])
    assert args.explicit_keys() == {"model.hidden_size", "train.train_iters", "model.num_layers", "optimizer.lr"}
    assert parse_args(["--recipe", "dit_tiny"]).explicit_keys() == frozenset()
