"""Device and process-group setup: megatron-core on CUDA as is, on CPU/gloo via a patch layer."""

from dfm.platform.device import compute_device, cpu_support_enabled, enable_cpu_support
from dfm.platform.distributed import (
    destroy_distributed,
    initialize_distributed,
    seed_everything,
    validate_parallel_layout,
)

__all__ = [
    "compute_device",
    "cpu_support_enabled",
    "destroy_distributed",
    "enable_cpu_support",
    "initialize_distributed",
    "seed_everything",
    "validate_parallel_layout",
]
