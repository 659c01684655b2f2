"""Wan's text encoder for data preparation: a UMT5 folder, or a diffusers pipeline folder with
tokenizer/ and text_encoder/, loads as UMT5EncoderModel and encodes as WanPipeline does (the
encoder's last hidden state, cut to each prompt's tokens)."""

import torch
from transformers import ByT5Tokenizer, UMT5Config, UMT5EncoderModel

from dfm.data.encoders.t5 import T5TextEncoder


def test_pipeline_folder_loads_umt5_and_encodes_like_wan(tmp_path):
    torch.manual_seed(0)
    config = UMT5Config(vocab_size=384, d_model=24, d_kv=6, d_ff=32, num_layers=2, num_heads=4)
    umt5 = UMT5EncoderModel(config).eval()
    umt5.save_pretrained(tmp_path / "text_encoder")
    tokenizer = ByT5Tokenizer()
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    encoder = T5TextEncoder.from_pretrained_or_cache(tmp_path, max_length=16)
    assert isinstance(encoder.model, UMT5EncoderModel) and encoder.embed_dim == 24
    prompts = ["a cat", "a dog running on grass"]
    tokens = tokenizer(prompts, padding="max_length", truncation=True, max_length=16, return_tensors="pt")
    with torch.no_grad():
        hidden = umt5(tokens.input_ids, tokens.attention_mask).last_hidden_state
    for ours, expected, length in zip(encoder.encode(prompts), hidden, tokens.attention_mask.sum(1)):
        assert torch.equal(ours, expected[: int(length)])
