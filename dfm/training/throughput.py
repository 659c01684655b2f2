"""Throughput and MFU: model FLOPs over time against the device's dense bf16 peak."""

from __future__ import annotations

import torch

# Dense bf16 tensor-core peaks (no sparsity), FLOP/s. Matched against the device name.
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "B200": 2250e12,
}


def device_peak_flops(device: torch.device) -> float | None:
    """Peak FLOP/s of ``device`` or None where unknown (CPUs): MFU is then reported as null."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_BF16_FLOPS.items():
        if key in name:
            return peak
    return None


def mfu(tflops_per_gpu: float, peak: float | None) -> float | None:
    return None if peak is None else tflops_per_gpu * 1e12 / peak
