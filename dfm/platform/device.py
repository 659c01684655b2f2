"""The device this process computes on."""

import os

import torch


def compute_device() -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA exists, else CPU (megatron-core runs there through dfm.platform.compat)."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")
