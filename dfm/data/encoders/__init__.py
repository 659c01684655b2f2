"""Frozen encoders shared by data preparation and inference: T5 text encoder, CLIP pooled text, VAEs."""

from dfm.data.encoders.clip import CLIPPooledEncoder
from dfm.data.encoders.t5 import T5TextEncoder
from dfm.data.encoders.tiny import TinyEncoderPaths, build_tiny_random_encoders, is_tiny_random, tiny_encoder_paths
from dfm.data.encoders.vae import VideoVAE

__all__ = [
    "CLIPPooledEncoder",
    "T5TextEncoder",
    "VideoVAE",
    "TinyEncoderPaths",
    "build_tiny_random_encoders",
    "is_tiny_random",
    "tiny_encoder_paths",
]
