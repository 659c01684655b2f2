"""examples/megatron/recipes/tiny_diffusers_folders.py (the README's tiny convert walk) writes folders
diffusers and the converters read: model_index.json naming each transformer, Wan 2.2's boundary_ratio."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "megatron" / "recipes" / "tiny_diffusers_folders.py"


def test_tiny_folders_are_pipeline_folders(tmp_path):
    spec = importlib.util.spec_from_file_location("tiny_diffusers_folders", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["--output", str(tmp_path)])
    wan22 = json.loads((tmp_path / "tiny_wan22" / "model_index.json").read_text())
    assert wan22["boundary_ratio"] == 0.875
    assert wan22["transformer_2"] == ["diffusers", "WanTransformer3DModel"]
    flux = json.loads((tmp_path / "tiny_flux" / "model_index.json").read_text())
    assert flux == {"_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"]}
    for folder in (
        "tiny_wan/transformer",
        "tiny_wan22/transformer_2",
        "tiny_flux/transformer",
        "tiny_wan_pipeline/vae",
    ):
        assert (tmp_path / folder / "config.json").is_file(), folder
    assert sorted(p.name for p in (tmp_path / "videos").iterdir()) == ["bars.json", "bars.mp4", "dots.json", "dots.mp4"]
