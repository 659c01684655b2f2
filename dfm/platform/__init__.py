"""Device and process-group setup: megatron-core on CUDA, and on CPU/gloo through the compat patches."""

from dfm.platform.device import compute_device
from dfm.platform.distributed import (
    destroy_distributed,
    initialize_distributed,
    seed_everything,
)

__all__ = [
    "compute_device",
    "destroy_distributed",
    "initialize_distributed",
    "seed_everything",
]
