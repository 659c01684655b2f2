"""T5 text encoder: captions -> embeddings [L_i, D].

T5 v1.1 (``T5EncoderModel``) or UMT5 (``UMT5EncoderModel``, Wan's umt5-xxl), by the folder's
config; a diffusers pipeline folder is read from the subfolders holding a T5: tokenizer/ and
text_encoder/ (Wan2.1-T2V-*-Diffusers), tokenizer_2/ and text_encoder_2/ (FLUX.1).

Two conventions: unpadded (the default; each caption keeps its real tokens, encoded with the
attention mask) and ``full_length`` (FLUX.1's, as FluxPipeline: every caption padded to
``max_length`` tokens and encoded without a mask, so the padding tokens are part of the text).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, T5EncoderModel, UMT5EncoderModel

from dfm.data.encoders.pipeline_folder import pipeline_encoder_folders

ENCODER_CLASSES = {"t5": T5EncoderModel, "umt5": UMT5EncoderModel}


class T5TextEncoder:
    def __init__(
        self, tokenizer, model: T5EncoderModel, name: str, max_length: int = 512, full_length: bool = False
    ) -> None:
        self.tokenizer = tokenizer
        self.model = model.eval().requires_grad_(False)
        self.name = name
        self.max_length = max_length
        self.full_length = full_length

    @classmethod
    def from_pretrained_or_cache(
        cls,
        name_or_dir: str | Path,
        cache_dir: str | Path | None = None,
        max_length: int = 512,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        full_length: bool = False,
    ) -> T5TextEncoder:
        """Load from a local folder (tokenizer + model saved together) or a hub name via ``cache_dir``."""
        source = str(name_or_dir)
        cache = str(cache_dir) if cache_dir is not None else None
        tokenizer_source, model_source = pipeline_encoder_folders(source, tuple(ENCODER_CLASSES))
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_source, cache_dir=cache)
        model_type = AutoConfig.from_pretrained(model_source, cache_dir=cache).model_type
        if model_type not in ENCODER_CLASSES:
            raise ValueError(
                f"{model_source}: text encoder type {model_type!r}; supported: {', '.join(ENCODER_CLASSES)}"
            )
        model_class = ENCODER_CLASSES[model_type]
        model = model_class.from_pretrained(model_source, cache_dir=cache, torch_dtype=dtype).to(device)
        return cls(tokenizer, model, name=source, max_length=max_length, full_length=full_length)

    @property
    def embed_dim(self) -> int:
        return int(self.model.config.d_model)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def encode_padded(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (embeddings [B, max_length, D] with zeros past each length, lengths [B]).

        Texts are padded or truncated to ``max_length`` tokens; ``lengths`` keeps the true
        (post-truncation) token count, or ``max_length`` with ``full_length`` (nothing zeroed).
        """
        tokens = self.tokenizer(
            list(texts), padding="max_length", truncation=True, max_length=self.max_length, return_tensors="pt"
        ).to(self.device)
        if self.full_length:
            hidden = self.model(input_ids=tokens.input_ids).last_hidden_state
            return hidden, torch.full((hidden.shape[0],), self.max_length)
        hidden = self.model(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask).last_hidden_state
        mask = tokens.attention_mask.unsqueeze(-1).to(hidden.dtype)
        return hidden * mask, tokens.attention_mask.sum(dim=1)

    def encode(self, texts: list[str]) -> list[torch.Tensor]:
        """-> one unpadded [L_i, D] float32 CPU tensor per text."""
        hidden, lengths = self.encode_padded(texts)
        return [h[: int(n)].float().cpu() for h, n in zip(hidden, lengths)]
