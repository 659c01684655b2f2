"""Acceptance: train the tiny DiT 2 iterations with a checkpoint, then generate an mp4 and a png from it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.zygote import checkout_env, python_args

RECIPE_DIR = Path(__file__).resolve().parents[2] / "examples" / "megatron" / "recipes" / "dit"
ENV = checkout_env({**os.environ, "OMP_NUM_THREADS": "1"})


def run_in_recipe_dir(script: str, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *python_args(), script, *args],
        cwd=RECIPE_DIR,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def checkpoint_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("train")
    result = run_in_recipe_dir(
        "pretrain_dit_model.py",
        [
            "--config-file",
            "conf/dit_tiny.yaml",
            "--mock",
            "train.train_iters=2",
            f"checkpoint.save={root / 'ckpt'}",
            f"logger.log_dir={root / 'logs'}",
        ],
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert (root / "ckpt" / "latest").is_file()
    return root / "ckpt"


def generate(checkpoint: Path, out: Path, extra: list[str]) -> subprocess.CompletedProcess:
    result = run_in_recipe_dir(
        "inference_dit_model.py",
        [
            "--checkpoint_path",
            str(checkpoint),
            "--tiny_random_encoders",
            "--prompt",
            "a tiny test",
            "--num_steps",
            "3",
            "--guidance_scale",
            "3.0",
            "--video_save_path",
            str(out),
            *extra,
        ],
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result


@pytest.mark.slow
def test_mp4_from_checkpoint_root(checkpoint_root, tmp_path):
    import imageio.v2 as imageio

    out = tmp_path / "sample.mp4"
    generate(checkpoint_root, out, ["--height", "32", "--width", "48", "--num_video_frames", "5"])
    # iter_data, not list(): the ffmpeg reader's len() is inf, which list() tries to preallocate.
    frames = [frame for frame in imageio.get_reader(out, format="ffmpeg").iter_data()]
    assert len(frames) == 5
    assert frames[0].shape == (32, 48, 3)


@pytest.mark.slow
def test_png_from_iteration_dir(checkpoint_root, tmp_path):
    import imageio.v2 as imageio

    out = tmp_path / "sample.png"
    generate(checkpoint_root / "iter_0000002", out, ["--height", "64", "--width", "32", "--num_video_frames", "1"])
    assert imageio.imread(out).shape[:2] == (64, 32)


@pytest.mark.slow
def test_config_is_read_from_the_checkpoint(checkpoint_root):
    from dfm.config.loader import build_config
    from dfm.inference.checkpoint_loading import checkpoint_config, checkpoint_directory, single_process_config

    directory = checkpoint_directory(checkpoint_root)
    assert directory.name == "iter_0000002"
    cfg = checkpoint_config(directory)
    assert cfg == build_config(None, str(checkpoint_root / "config.yaml"))  # common state == saved YAML
    assert (cfg.model.in_channels, cfg.model.text_embed_dim, cfg.train.train_iters) == (4, 32, 2)
    assert single_process_config(cfg).model.tensor_model_parallel_size == 1


def test_missing_checkpoint_is_named(tmp_path):
    from dfm.inference.checkpoint_loading import checkpoint_directory

    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        checkpoint_directory(tmp_path)


@pytest.mark.parametrize("bad", [["--guidance_scale", "-5"], ["--guidance_scale", "nan"], ["--num_steps", "0"]])
def test_bad_sampling_arguments_are_refused(bad, capsys):
    from dfm.inference.generate import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--checkpoint_path", "ckpt", *bad])
    assert (
        exit_info.value.code == 2
        and f"{bad[0]} {float(bad[1]) if 'guidance' in bad[0] else bad[1]}" in capsys.readouterr().err
    )
