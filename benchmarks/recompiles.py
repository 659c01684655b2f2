"""How often ``model.compile=true`` compiles over a stream of mixed packs (changing lengths).

    python -m benchmarks.recompiles [--packs 50] [--backend inductor|aot_eager] [--config FILE] [key=value ...]

Runs forward + backward of the tiny mixed image/video config's mock packs through the compiled
model on one process and prints the number of distinct pack lengths next to the graphs compiled:
with dynamic shapes the graphs are compiled for the first pack and reused by every later one.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch._dynamo

from dfm.config.loader import build_config
from dfm.models.build import build_model_chunk
from dfm.models.common import fused
from dfm.parallel.layout import ParallelLayout
from dfm.platform.distributed import destroy_distributed, initialize_distributed
from dfm.training.data import build_train_loader

TINY = Path(__file__).resolve().parents[1] / "examples" / "megatron" / "recipes" / "dit" / "conf" / "dit_tiny.yaml"


def graphs_compiled() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def run(packs: int, backend: str, config: str, overrides: list[str]) -> dict:
    cfg = build_config(None, config, ["model.compile=true", *overrides], world_size=1)
    initialize_distributed(ParallelLayout.from_config(cfg.model, 1), seed=cfg.rng.seed)
    try:
        if backend != "inductor":
            compile_region = fused.compile_region
            fused.compile_region = lambda fn, _backend="inductor": compile_region(fn, backend)
        model, _ = build_model_chunk(cfg.model, "fp32", cfg.rng.seed)
        loader = build_train_loader(cfg, ParallelLayout.from_config(cfg.model, 1), mock=True)
        lengths, graphs, start = set(), [], time.perf_counter()
        for _ in range(packs):
            pack = next(loader)
            c_noise = torch.rand(pack.num_samples)
            model(pack.latents, c_noise, pack).square().mean().backward()
            lengths.add(pack.seq_len)
            graphs.append(graphs_compiled())
        return {
            "packs": packs,
            "distinct_pack_lengths": len(lengths),
            "graphs_after_first_pack": graphs[0],
            "graphs_after_last_pack": graphs[-1],
            "seconds": round(time.perf_counter() - start, 1),
        }
    finally:
        destroy_distributed()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--packs", type=int, default=50)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager: no code generation)")
    parser.add_argument("--config", default=str(TINY))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    result = run(args.packs, args.backend, args.config, args.overrides)
    print(
        f"{result['packs']} packs of {result['distinct_pack_lengths']} distinct lengths: "
        f"graphs compiled after the first pack {result['graphs_after_first_pack']}, "
        f"after the last {result['graphs_after_last_pack']} ({result['seconds']} s, backend {args.backend})"
    )


if __name__ == "__main__":
    main()
