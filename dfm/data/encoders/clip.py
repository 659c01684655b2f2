"""CLIP's pooled text embedding (FLUX.1's second text input): captions -> one vector [D] each.

As FluxPipeline computes it: the caption padded or truncated to the tokenizer's 77 tokens, through
``CLIPTextModel`` without an attention mask (CLIP's causal mask already hides the padding from the
end-of-text token), and ``pooler_output`` (the end-of-text token's state) kept: 768 wide for CLIP-L.
A FLUX.1 pipeline folder is read from its tokenizer/ and text_encoder/.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, CLIPTextModel

from dfm.data.encoders.pipeline_folder import pipeline_encoder_folders

CLIP_MODEL_TYPES = ("clip_text_model",)


class CLIPPooledEncoder:
    def __init__(self, tokenizer, model: CLIPTextModel, name: str) -> None:
        self.tokenizer = tokenizer
        self.model = model.eval().requires_grad_(False)
        self.name = name

    @classmethod
    def from_pretrained(
        cls, name_or_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> CLIPPooledEncoder:
        """A folder holding tokenizer + CLIPTextModel, or a FLUX.1 pipeline folder (tokenizer/, text_encoder/)."""
        tokenizer_source, model_source = pipeline_encoder_folders(str(name_or_dir), CLIP_MODEL_TYPES)
        model_type = AutoConfig.from_pretrained(model_source).model_type
        if model_type not in CLIP_MODEL_TYPES:
            raise ValueError(f"{model_source}: text encoder type {model_type!r}, expected a CLIP text model")
        model = CLIPTextModel.from_pretrained(model_source, torch_dtype=dtype).to(device)
        return cls(AutoTokenizer.from_pretrained(tokenizer_source), model, name=str(name_or_dir))

    @property
    def embed_dim(self) -> int:
        return int(self.model.config.hidden_size)

    @torch.no_grad()
    def encode(self, texts: list[str]) -> torch.Tensor:
        """-> pooled embeddings [B, D] float32 on the CPU."""
        tokens = self.tokenizer(
            list(texts),
            padding="max_length",
            max_length=self.tokenizer.model_max_length,
            truncation=True,
            return_tensors="pt",
        )
        device = next(self.model.parameters()).device
        return self.model(tokens.input_ids.to(device)).pooler_output.float().cpu()
