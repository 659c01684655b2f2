"""Tiny random diffusers folders to rehearse the convert workflows on a CPU without downloads.

    python examples/megatron/recipes/tiny_diffusers_folders.py --output outputs/tiny

writes, under OUT (the same tiny models tests/wan and tests/flux build):
  tiny_wan/            a WanPipeline folder holding only transformer/ (WanTransformer3DModel, 2 layers)
  tiny_wan22/          a Wan 2.2 A14B-shaped folder: transformer/ (high noise), transformer_2/ (low noise),
                       boundary_ratio 0.875
  tiny_wan_pipeline/   what data preparation reads of a Wan pipeline: text_encoder/ + tokenizer/ (UMT5), vae/
  videos/              two captioned 5-frame clips (sidecar captions)
  tiny_flux/           a FluxPipeline folder holding only transformer/ (FluxTransformer2DModel, 2 + 2 blocks)
Random weights: numbers, not pictures. Run from the repository root (it reuses tests/*/_tiny.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for tests/*/_tiny.py


def write_pipeline_folder(folder: Path, pipeline: str, transformers: dict, **index) -> None:
    """``folder/<name>`` per transformer and a model_index.json naming them (plus ``index``), as a
    downloaded pipeline folder has."""
    for name, model in transformers.items():
        model.save_pretrained(folder / name)
        index[name] = ["diffusers", type(model).__name__]
    (folder / "model_index.json").write_text(json.dumps({"_class_name": pipeline, **index}))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, help="a new folder")
    out = Path(parser.parse_args(argv).output)
    from tests.flux._tiny import tiny_diffusers_flux
    from tests.wan._tiny import tiny_diffusers_wan, tiny_wan_pipeline_folder, write_tiny_videos

    write_pipeline_folder(out / "tiny_wan", "WanPipeline", {"transformer": tiny_diffusers_wan()})
    experts = {"transformer": tiny_diffusers_wan(seed=0), "transformer_2": tiny_diffusers_wan(seed=1)}
    write_pipeline_folder(out / "tiny_wan22", "WanPipeline", experts, boundary_ratio=0.875)
    tiny_wan_pipeline_folder(out / "tiny_wan_pipeline")
    write_tiny_videos(out / "videos")
    write_pipeline_folder(out / "tiny_flux", "FluxPipeline", {"transformer": tiny_diffusers_flux()})
    print(f"wrote {out}/tiny_wan, tiny_wan22, tiny_wan_pipeline, videos, tiny_flux")


if __name__ == "__main__":
    main(sys.argv[1:])
