"""FLUX forward at TP=2 + SP, CP=2 and PP=2 against diffusers, all in one 2-process launch.

Usage: torchrun --nproc-per-node 2 _layouts_worker.py CASE OUT_DIR. CASE (a torch file written by
the test) holds the diffusers config, the converted full weights and diffusers' output for every
sample of ``verification_pack`` run alone. Each layout re-initialises megatron's parallel state,
builds its shard of the model, runs the pack and saves {layout: max abs diff} to
OUT_DIR/rank<R>.json (None: no output on this rank).
"""

import dfm  # noqa: F401  before megatron: dfm defers megatron-core's start-up imports (import_cost.py)

# isort: split
import json
import sys
from pathlib import Path

import torch
from megatron.core import parallel_state

from dfm.convert.flux import FLUX, per_sample_max_abs_diff, verification_pack
from dfm.convert.import_export import import_config
from dfm.models.build import build_model
from dfm.models.common.init import mark_tensor_parallel_weights, take_shard
from dfm.parallel import ParallelLayout
from dfm.platform.distributed import destroy_distributed, initialize_distributed
from dfm.platform.process_exit import skip_final_gc_at_exit

LAYOUTS = {"tp2_sp": dict(tp=2, sp=True), "cp2": dict(cp=2), "pp2": dict(pp=2)}


@torch.no_grad()
def load_shards(model, weights: dict) -> None:
    mark_tensor_parallel_weights(model)
    for name, param in model.named_parameters():
        param.copy_(take_shard(weights[model.global_param_name(name)], param))


def run_layout(model_cfg, weights, layout: ParallelLayout, references: list) -> float | None:
    model, _ = build_model(model_cfg, "fp32", layout=layout)
    load_shards(model, weights)
    model.eval()
    batch, t, guidance = verification_pack(model_cfg, padding=layout.padding_multiples())
    with torch.no_grad():
        if not parallel_state.is_pipeline_first_stage():
            # Stage 1 takes stage 0's hidden [s_text + s_image, 1, h], as the pipeline schedule hands it over.
            hidden = torch.empty(batch.context.shape[0] + batch.seq_len, 1, model_cfg.hidden_size)
            torch.distributed.recv(hidden, src=0)
            model.set_input_tensor(hidden)
        out = model(batch.latents, t, batch, guidance)
        if not parallel_state.is_pipeline_last_stage():
            torch.distributed.send(out.contiguous(), dst=1)
            return None
    return max(per_sample_max_abs_diff(out, references, batch))


def main(case: Path, out_dir: Path) -> None:
    case = torch.load(case)
    cfg = import_config(FLUX, case["config"], None, ["model.attention_backend=sdpa"])  # pinned: compared numerics
    weights, references = case["weights"], case["references"]
    results = {}
    for name, sizes in LAYOUTS.items():
        layout = ParallelLayout(world_size=2, **sizes)
        initialize_distributed(layout)
        try:
            results[name] = run_layout(cfg.model, weights, layout, references)
        finally:
            parallel_state.destroy_model_parallel()
    (out_dir / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(results))
    destroy_distributed()


if __name__ == "__main__":
    skip_final_gc_at_exit()
    main(Path(sys.argv[1]), Path(sys.argv[2]))
