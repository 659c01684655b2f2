"""Wan weights through dfm and back, via examples/megatron/recipes/wan/convert_wan.py's code:

* import then export reproduces every tensor of a diffusers folder bit for bit, and the exported
  folder loads in diffusers; ``--verify`` prints the dfm-vs-diffusers difference;
* the real entry point fine-tunes the imported model 3 iterations at TP=2 (``checkpoint.pretrained``)
  on energon shards that prepare_energon_dataset.py wrote with Wan's encoders (a tiny pipeline folder:
  UMT5, AutoencoderKLWan), and the export of that run loads in diffusers with exactly the run's weights.
"""

import re

import pytest
import torch
from safetensors.torch import load_file

from dfm.convert.cli import main
from dfm.convert.pretrained import read_full_weights
from dfm.convert.rules import to_dfm
from dfm.convert.wan import WAN, rules
from tests.training.entry import RECIPE_DIR, prepare_shards, read_metrics, run_entry
from tests.wan._tiny import tiny_diffusers_wan, tiny_wan_pipeline_folder, write_tiny_videos

WAN_TINY = RECIPE_DIR / "conf" / "wan_tiny.yaml"
TINY_TEXT = ["model.max_text_len=16", "dataset.mock_text_len_range=[4,12]"]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(diffusers pipeline folder, its transformer's state dict, the imported dfm checkpoint root, the
    --verify output); tests/convert/test_converter_folders.py imports a bare model folder."""
    tmp = tmp_path_factory.mktemp("wan_convert")
    folder = tmp / "diffusers"
    tiny_diffusers_wan().save_pretrained(folder / "transformer")
    (folder / "model_index.json").write_text(
        '{"_class_name": "WanPipeline", "transformer": ["diffusers", "WanTransformer3DModel"]}'
    )
    state = load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors")
    checkpoint = tmp / "imported"
    return (
        folder,
        state,
        checkpoint,
        _run_cli(["import", "--diffusers", str(folder), "--output", str(checkpoint), "--verify", *TINY_TEXT]),
    )


def _run_cli(argv: list[str]) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(WAN, argv) == 0
    return out.getvalue()


def load_in_diffusers(folder):
    import diffusers

    return diffusers.WanTransformer3DModel.from_pretrained(folder, torch_dtype=torch.float32)


def test_import_verifies_against_diffusers(imported):
    *_, output = imported
    diff = float(re.search(r"max abs diff vs diffusers: (\S+)", output).group(1))
    assert diff <= 1e-5


def test_import_export_round_trip_is_bit_exact(imported, tmp_path):
    folder, state, checkpoint, _ = imported
    _run_cli(["export", "--checkpoint", str(checkpoint), "--output", str(tmp_path / "export")])
    exported = load_file(tmp_path / "export" / "diffusion_pytorch_model.safetensors")
    assert sorted(exported) == sorted(state)
    for name, tensor in state.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    loaded = load_in_diffusers(tmp_path / "export")
    assert loaded.config.num_layers == 2 and loaded.config.qk_norm == "rms_norm_across_heads"


def prepare_with_wan_encoders(tmp_path, *extra: str):
    """Energon shards of two tiny clips, encoded by a tiny Wan pipeline folder's UMT5 and VAE; ``extra``:
    more prepare_energon_dataset.py flags."""
    tiny_wan_pipeline_folder(tmp_path / "wan_pipeline")
    write_tiny_videos(tmp_path / "videos")
    flags = ["--caption_format", "sidecar", "--height", 32, "--width", 48, "--num_frames", 5, "--max_text_len", 16]
    flags += ["--t5", tmp_path / "wan_pipeline", "--vae", tmp_path / "wan_pipeline", *extra]
    return prepare_shards(tmp_path / "videos", tmp_path / "shards", *flags)


def finetune_overrides(data, pretrained, run) -> list[str]:
    """A 3-iteration fine-tune of ``pretrained`` on the shards ``data``, saved and logged under ``run``."""
    return [
        f"dataset.path={data}",
        "dataset.num_workers=0",
        f"checkpoint.pretrained={pretrained}",
        f"checkpoint.save={run / 'checkpoints'}",
        "checkpoint.save_interval=3",
        "train.train_iters=3",
        f"logger.log_dir={run / 'logs'}",
    ]


@pytest.mark.slow
def test_finetune_at_tp2_then_export_loads_in_diffusers(imported, tmp_path):
    _, state, checkpoint, _ = imported
    run = tmp_path / "run"
    overrides = [
        *finetune_overrides(prepare_with_wan_encoders(tmp_path), checkpoint, run),
        "model.tensor_model_parallel_size=2",
    ]
    result = run_entry(2, overrides, config=WAN_TINY, mock=False)
    assert result.returncode == 0, result.stderr[-4000:]
    assert [m["iteration"] for m in read_metrics(run / "logs")] == [1, 2, 3]
    _run_cli(["export", "--checkpoint", str(run / "checkpoints"), "--output", str(tmp_path / "export")])
    loaded = load_in_diffusers(tmp_path / "export")
    cfg, trained = read_full_weights(run / "checkpoints")
    cfg_rules = rules(cfg.model)
    assert to_dfm(loaded.state_dict(), cfg_rules).keys() == trained.keys()
    for name, tensor in to_dfm(loaded.state_dict(), cfg_rules).items():
        assert torch.equal(tensor, trained[name]), name
    # Started from the imported weights, whatever the layout: 3 Adam steps at lr 1e-4 move each
    # weight by at most ~3e-4 (a mis-sharded load would be off by the weights' own size, ~0.1).
    initial = to_dfm(state, cfg_rules)
    moved = {name: (trained[name] - initial[name]).abs().max().item() for name in trained}
    assert 0 < max(moved.values()) <= 3.1e-4, max(moved.items(), key=lambda item: item[1])
