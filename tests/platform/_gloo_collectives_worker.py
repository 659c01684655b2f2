"""Worker for tests/platform/test_gloo_collectives.py: megatron's distributed-optimizer collectives
on gloo, patched (in place) against gloo's own, bit for bit, and the bytes each adds to the peak.

Usage: torchrun --nproc-per-node N _gloo_collectives_worker.py OUT_DIR -> OUT_DIR/rank<R>.json
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager

from dfm.platform.compat.gloo_reduce import all_gather_in_place_on_gloo, reduce_scatter_in_place_on_gloo

SIZES = (5, 4099, 1 << 20)  # per rank; the last above gloo's segment sizes
PEAK_SIZE = 1 << 22  # fp32 elements per rank of the bucket whose copy the peak shows (16 MiB)


def wide_values(numel: int, seed: int) -> torch.Tensor:
    """fp32 values over many magnitudes, so a different summation order shows in the bits."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g) * torch.exp(3 * torch.randn(numel, generator=g))


def reduce(function, bucket: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Reduce ``bucket`` into this rank's chunk, as megatron's start_grad_sync does; -> the chunk (a view:
    a copy here would be counted in the collective's peak)."""
    chunk = bucket.view(size, -1)[rank]
    with _coalescing_manager(dist.group.WORLD):
        function(chunk, bucket, op=dist.ReduceOp.SUM, group=dist.group.WORLD)
    return chunk


def gather(function, bucket: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Gather every rank's chunk into ``bucket``, as megatron's start_param_sync does; -> the bucket."""
    with _coalescing_manager(dist.group.WORLD):
        function(bucket, bucket.view(size, -1)[rank], group=dist.group.WORLD)
    return bucket


def peak_added(call) -> int:
    """Bytes ``call()`` adds to this process's peak RSS (Linux VmHWM, reset before)."""
    Path("/proc/self/clear_refs").write_text("5")
    before = _vm("VmHWM")
    call()
    return _vm("VmHWM") - before


def _vm(key: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key + ":"))
    return int(line.split()[1]) * 1024


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    patched_rs = reduce_scatter_in_place_on_gloo(dist.reduce_scatter_tensor)
    patched_ag = all_gather_in_place_on_gloo(dist.all_gather_into_tensor)
    same_reduced, same_gathered = [], []
    for numel in SIZES:
        grads = wide_values(numel * size, seed=rank)
        reduced = [reduce(f, grads.clone(), rank, size) for f in (dist.reduce_scatter_tensor, patched_rs)]
        same_reduced.append(torch.equal(*reduced))
        params = torch.where(torch.arange(numel * size) // numel == rank, grads, torch.nan).bfloat16()
        gathered = [gather(f, params.clone(), rank, size) for f in (dist.all_gather_into_tensor, patched_ag)]
        same_gathered.append(torch.equal(*gathered) and not gathered[0].isnan().any().item())
    bucket = wide_values(PEAK_SIZE * size, seed=rank)
    peaks = {
        name: peak_added(lambda f=function: reduce(f, bucket, rank, size))
        for name, function in (("gloo", dist.reduce_scatter_tensor), ("in_place", patched_rs))
    }
    record = {"same_reduced": same_reduced, "same_gathered": same_gathered, "peaks": peaks, "bucket": bucket.nbytes}
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
