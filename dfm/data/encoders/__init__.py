"""Frozen encoders shared by data preparation and inference: T5 text encoder and VAEs."""

from dfm.data.encoders.t5 import T5TextEncoder
from dfm.data.encoders.tiny import TinyEncoderPaths, build_tiny_random_encoders, is_tiny_random
from dfm.data.encoders.vae import VideoVAE

__all__ = ["T5TextEncoder", "VideoVAE", "TinyEncoderPaths", "build_tiny_random_encoders", "is_tiny_random"]
