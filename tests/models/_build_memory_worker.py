"""The bytes a rank allocates while it builds a model, run as 4 gloo ranks.

Usage: torchrun --nproc-per-node 4 _build_memory_worker.py OUT_DIR. Builds a wide DiT at TP=2 x DP=2
(``build_model_chunk``, as DDP runs build) and at DP=4 under Megatron-FSDP ``optim_grads_params``
in fp32 and bf16 (``setup.build_model``), tracking the live bytes of every CPU tensor created meanwhile, and saves
per case the peak, what the rank keeps after the build (its share), the bytes alive when FSDP
starts sharding and the sizes the bound is made of to OUT_DIR/rank<R>.pt; the FSDP case also saves
how far its gathered rows are from the same model built in one piece (0: bit-identical).
"""

import dfm  # noqa: F401  before megatron: dfm defers megatron-core's start-up imports (import_cost.py)

# isort: split
import sys
import weakref
from pathlib import Path

import torch
from megatron.core import parallel_state
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dfm.config.loader import build_config
from dfm.models.build import build_model_chunk
from dfm.models.common import init
from dfm.parallel import ParallelLayout
from dfm.parallel.fsdp_shards import gather_rows, named_parameters
from dfm.platform.distributed import destroy_distributed, initialize_distributed
from dfm.platform.process_exit import skip_final_gc_at_exit
from dfm.training import setup
from tests.training.entry import TINY

WORLD, CHUNK_BYTES = 4, 64 << 10
WIDE = ["model.hidden_size=256", "model.num_layers=12", "model.num_attention_heads=4", "train.global_batch_size=4"]
FSDP = ["ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params"]


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the CPU storages created inside the block and alive, following storages resized
    in place (Megatron-FSDP frees its temporary buckets by resizing their storage to 0)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.sizes: dict[int, int] = {}  # id(storage) -> its bytes; storages keep their Python object

    def __enter__(self):
        self.resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage, size):
            before = storage.nbytes()
            result = tracker.resize(storage, size)
            if id(storage) in tracker.sizes:
                tracker._add(id(storage), storage.nbytes() - before)
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self.resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if type(tensor) is torch.Tensor and tensor.device.type == "cpu":
                storage = tensor.untyped_storage()
                if id(storage) not in self.sizes:
                    self.sizes[id(storage)] = 0
                    self._add(id(storage), storage.nbytes())
                    weakref.finalize(storage, self._free, id(storage))
        return out

    def _add(self, key: int, nbytes: int) -> None:
        self.sizes[key] += nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def _free(self, key: int) -> None:
        self.live -= self.sizes.pop(key)


def param_bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def tp_case() -> dict:
    cfg = build_config(None, str(TINY), [*WIDE, "model.tensor_model_parallel_size=2"], world_size=WORLD)
    layout = ParallelLayout.from_config(cfg.model, WORLD)
    initialize_distributed(layout)
    with LiveBytes() as tracker:
        model, _ = build_model_chunk(cfg.model, "fp32", 0, layout=layout)
    largest_full = max(
        p.numel() * 4 * (2 if getattr(p, "tensor_model_parallel", False) else 1) for p in model.parameters()
    )
    result = dict(
        peak=tracker.peak, kept=tracker.live, share=param_bytes(model.parameters()), largest_full=largest_full
    )
    del model
    parallel_state.destroy_model_parallel()
    return result


def fsdp_case(precision: str) -> dict:
    cfg = build_config(None, str(TINY), [*WIDE, *FSDP, f"mixed_precision.precision={precision}"], world_size=WORLD)
    layout = ParallelLayout.from_config(cfg.model, WORLD)
    device = initialize_distributed(layout)
    wrap, before_sharding = setup.fully_sharded, []

    def fully_sharded(*args, **kwargs):
        before_sharding.append(tracker.live)
        return wrap(*args, **kwargs)

    setup.fully_sharded = fully_sharded
    with LiveBytes() as tracker:
        model, _ = setup.build_model(cfg, layout, device)
    setup.fully_sharded = wrap
    peak, kept = tracker.peak, tracker.live
    reference, _ = build_model_chunk(cfg.model, precision, cfg.rng.seed, layout=layout, params_dtype_everywhere=True)
    expected = dict(reference.named_parameters())
    # The fp32 main weights hold the (bf16) model's values.
    largest_diff = max(
        (gather_rows(shard) - expected[name].float()).abs().max().item() for name, shard in named_parameters(model[0])
    )
    units = [param_bytes(layer.parameters()) for layer in reference.layers]
    modules = [param_bytes(m.parameters(recurse=False)) for m in reference.modules()]
    parallel_state.destroy_model_parallel()
    return dict(
        peak=peak,
        kept=kept,
        before_sharding=before_sharding[0],
        model=param_bytes(reference.parameters()),
        largest_unit=max(units),
        largest_module=max(modules),
        largest_diff=largest_diff,
    )


def main(out_dir: str) -> None:
    init.CHUNK_BYTES = CHUNK_BYTES
    try:
        results = {"chunk": CHUNK_BYTES, "tp": tp_case(), "fsdp": fsdp_case("fp32"), "fsdp_bf16": fsdp_case("bf16")}
        torch.save(results, Path(out_dir) / f"rank{torch.distributed.get_rank()}.pt")
    finally:
        destroy_distributed()


if __name__ == "__main__":
    skip_final_gc_at_exit()
    main(sys.argv[1])
