"""HunyuanVideo 1.5's encoders, run through diffusers' own pipeline functions so the shards hold
exactly what HunyuanVideo15(ImageToVideo)Pipeline feeds its transformer:

* Qwen2.5-VL text (the chat template, the hidden state 3 from the end, the template's first 108
  tokens cropped) and ByT5 glyph text (quoted text of the caption; none: no tokens);
* the video latent (the VAE's mode x scaling_factor), the first frame's latent (encoded alone, as the
  image-to-video pipeline does) and its SigLIP embedding (last hidden state).

``build_tiny_hunyuan_encoders`` saves tiny random ones (a byte-level Qwen tokenizer with a chat
template, Qwen2_5_VLTextModel, ByT5, SiglipVisionModel, AutoencoderKLHunyuanVideo15) for tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import AutoencoderKLHunyuanVideo15
from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor
from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5_image2video import (
    HunyuanVideo15ImageToVideoPipeline as Pipeline,
)
from transformers import (
    ByT5Tokenizer,
    Qwen2_5_VLTextConfig,
    Qwen2_5_VLTextModel,
    Qwen2Tokenizer,
    SiglipImageProcessor,
    SiglipVisionConfig,
    SiglipVisionModel,
    T5EncoderModel,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

from dfm.data.encoders.tiny import _mark, build_tiny_t5

# HunyuanVideo15Pipeline's text settings (its __init__).
QWEN_MAX_LENGTH, QWEN_CROP_START, BYT5_MAX_LENGTH = 1000, 108, 256
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class HunyuanEncoders:
    qwen: Qwen2_5_VLTextModel
    qwen_tokenizer: Qwen2Tokenizer
    byt5: T5EncoderModel
    byt5_tokenizer: ByT5Tokenizer
    siglip: SiglipVisionModel
    siglip_processor: SiglipImageProcessor
    vae: AutoencoderKLHunyuanVideo15
    name: str
    # The pipeline's tokenizer_max_length / tokenizer_2_max_length (set both alike to change them).
    qwen_max_length: int = QWEN_MAX_LENGTH
    byt5_max_length: int = BYT5_MAX_LENGTH

    @classmethod
    def from_folder(cls, folder: str | Path, device: str = "cpu", **lengths) -> HunyuanEncoders:
        """A HunyuanVideo 1.5 image-to-video pipeline folder (text_encoder, tokenizer, text_encoder_2,
        tokenizer_2, image_encoder, feature_extractor, vae), or the tiny ones' folder of the same layout."""
        folder = Path(folder)
        return cls(
            qwen=Qwen2_5_VLTextModel.from_pretrained(folder / "text_encoder").to(device).eval(),
            qwen_tokenizer=Qwen2Tokenizer.from_pretrained(folder / "tokenizer"),
            byt5=T5EncoderModel.from_pretrained(folder / "text_encoder_2").to(device).eval(),
            byt5_tokenizer=ByT5Tokenizer.from_pretrained(folder / "tokenizer_2"),
            siglip=SiglipVisionModel.from_pretrained(folder / "image_encoder").to(device).eval(),
            siglip_processor=SiglipImageProcessor.from_pretrained(folder / "feature_extractor"),
            vae=AutoencoderKLHunyuanVideo15.from_pretrained(folder / "vae").to(device).eval(),
            name=str(folder),
            **lengths,
        )

    @property
    def device(self) -> torch.device:
        return next(self.qwen.parameters()).device

    @torch.no_grad()
    def encode_text(self, caption: str) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (Qwen [L, D], ByT5 [L2, D2]), each its real tokens only."""
        qwen, qwen_mask = Pipeline._get_mllm_prompt_embeds(
            self.qwen, self.qwen_tokenizer, caption, self.device, self.qwen_max_length, crop_start=QWEN_CROP_START
        )
        byt5, byt5_mask = Pipeline._get_byt5_prompt_embeds(
            self.byt5_tokenizer, self.byt5, caption, self.device, self.byt5_max_length
        )
        return qwen[0][qwen_mask[0].bool()].float().cpu(), byt5[0][byt5_mask[0].bool()].float().cpu()

    @torch.no_grad()
    def encode_video(self, video: torch.Tensor) -> torch.Tensor:
        """video [1, 3, F, H, W] in [-1, 1] -> latent [C, T, H', W'] (mode x scaling_factor)."""
        latent = self.vae.encode(video.to(self.device, self.vae.dtype)).latent_dist.mode()
        return (latent[0] * self.vae.config.scaling_factor).float().cpu()

    @torch.no_grad()
    def encode_first_frame(self, image, height: int | None = None, width: int | None = None):
        """PIL image (a clip's first frame) -> (its latent at ``height`` x ``width`` pixels (default: its
        size) [C, 1, H', W'], its SigLIP embedding [L_img, D_img])."""
        processor = HunyuanVideo15ImageProcessor(vae_scale_factor=self.vae.spatial_compression_ratio)
        height, width = height or image.height, width or image.width
        latent = Pipeline._get_image_latents(self.vae, processor, image, height, width, self.device)
        embeds = Pipeline._get_image_embeds(self.siglip, self.siglip_processor, image, self.device)
        return latent[0].float().cpu(), embeds[0].float().cpu()


def tiny_qwen_tokenizer() -> Qwen2Tokenizer:
    """Byte-level BPE over the 256 byte symbols (no merges) with Qwen's chat special tokens and a chat template."""
    vocab = {s: i for i, s in enumerate(bytes_to_unicode().values())}
    for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab, merges=[], unk_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def build_tiny_hunyuan_encoders(
    out_dir: str | Path,
    seed: int = 0,
    text_dim: int = 24,
    text_2_dim: int = 20,
    image_dim: int = 12,
    latent_channels: int = 4,
) -> Path:
    """Tiny random HunyuanVideo 1.5 encoders saved in a pipeline folder's layout under ``out_dir``."""
    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    tokenizer = tiny_qwen_tokenizer()
    qwen = Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=text_dim,
        intermediate_size=2 * text_dim,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 2]},
        pad_token_id=tokenizer.pad_token_id,
    )
    Qwen2_5_VLTextModel(qwen).save_pretrained(out_dir / "text_encoder")
    tokenizer.save_pretrained(out_dir / "tokenizer")
    build_tiny_t5(out_dir / "text_encoder_2", seed, text_2_dim)
    ByT5Tokenizer().save_pretrained(out_dir / "tokenizer_2")
    siglip = SiglipVisionConfig(
        hidden_size=image_dim,
        intermediate_size=2 * image_dim,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
    )
    SiglipVisionModel(siglip).save_pretrained(out_dir / "image_encoder")
    SiglipImageProcessor(size={"height": 32, "width": 32}).save_pretrained(out_dir / "feature_extractor")
    AutoencoderKLHunyuanVideo15(
        latent_channels=latent_channels,
        block_out_channels=(8, 8, 16, 16),
        layers_per_block=1,
        spatial_compression_ratio=8,
        temporal_compression_ratio=4,
    ).save_pretrained(out_dir / "vae")
    for part in ("text_encoder", "image_encoder", "vae"):
        _mark(out_dir / part, part, seed)
    return out_dir


class HunyuanTextAdapter:
    """The preparation's text encoder interface (``encode([caption]) -> [Qwen [L, D]]``, ``name``)."""

    def __init__(self, encoders: HunyuanEncoders):
        self.encoders, self.name = encoders, encoders.name + ":text_encoder"

    def encode(self, captions: list[str]) -> list[torch.Tensor]:
        return [self.encoders.encode_text(caption)[0] for caption in captions]


class HunyuanVAEAdapter:
    """The preparation's VAE interface (``encode``, compressions, ``name``, ``kind``)."""

    kind = "hunyuan_video15"

    def __init__(self, encoders: HunyuanEncoders):
        self.encoders, self.name = encoders, encoders.name + ":vae"
        self.spatial_compression = encoders.vae.spatial_compression_ratio
        self.temporal_compression = encoders.vae.temporal_compression_ratio

    def encode(self, video: torch.Tensor) -> torch.Tensor:
        return self.encoders.encode_video(video)[None]


def first_frame_image(video: torch.Tensor):
    """video [3, T, H, W] in [-1, 1] -> its first frame as an RGB PIL image."""
    from PIL import Image

    pixels = ((video[:, 0].permute(1, 2, 0) + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
    return Image.fromarray(pixels.numpy())


def hunyuan_parts(encoders: HunyuanEncoders, video: torch.Tensor, caption: str) -> dict[str, torch.Tensor]:
    """The shard's extra parts of one clip (video [3, T, H, W] in [-1, 1])."""
    from dfm.data.prepare.shards import BYT5_PART, FIRST_FRAME_PART, IMAGE_PART

    first_frame, image_embeds = encoders.encode_first_frame(first_frame_image(video))
    return {BYT5_PART: encoders.encode_text(caption)[1], FIRST_FRAME_PART: first_frame, IMAGE_PART: image_embeds}
