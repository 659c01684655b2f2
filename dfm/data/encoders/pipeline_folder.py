"""Where a text encoder sits in a diffusers pipeline folder (Wan: text_encoder/; FLUX.1: CLIP in
text_encoder/, T5 in text_encoder_2/), found by the encoder's config rather than by the pipeline's name."""

from __future__ import annotations

import json
from pathlib import Path

# (tokenizer, text encoder) subfolders of a diffusers pipeline folder, in the order they are tried.
PIPELINE_SUBFOLDERS = (("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2"))


def pipeline_encoder_folders(source: str, model_types: tuple[str, ...]) -> tuple[str, str]:
    """(tokenizer, model) sources: in a diffusers pipeline folder, the first subfolder pair whose text
    encoder is one of ``model_types``; else ``source`` itself for both."""
    root = Path(source)
    for tokenizer, encoder in PIPELINE_SUBFOLDERS:
        config = root / encoder / "config.json"
        if (root / tokenizer).is_dir() and config.is_file():
            if json.loads(config.read_text()).get("model_type") in model_types:
                return str(root / tokenizer), str(root / encoder)
    return source, source
