"""What the per-family ``_layouts_worker.py`` scripts share on each rank (tests/_layouts.py launches
them and checks what they write): megatron's parallel state per layout, a model's shard of the full
weights, the gradient reductions megatron adds to backward, the pipeline's hand-over between two
stages, and the per-rank results file."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from megatron.core import parallel_state

from dfm.models.build import build_model_chunk
from dfm.models.common.init import take_shard
from dfm.parallel import ParallelLayout
from dfm.platform.distributed import destroy_distributed

LAYOUTS = {
    "tp2_sp": ParallelLayout(world_size=2, tp=2, sp=True),
    "cp2": ParallelLayout(world_size=2, cp=2),
    "pp2": ParallelLayout(world_size=2, pp=2),
}


def enter_layout(layout: ParallelLayout) -> None:
    """Megatron's parallel state re-initialised for ``layout`` (one launch runs every layout)."""
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(**layout.megatron_parallel_kwargs())


@torch.no_grad()
def sharded_model(model_cfg, layout: ParallelLayout, weights: dict):
    """This rank's shard of the fp32 model of ``model_cfg``, holding ``weights`` ({global name: full tensor})."""
    model, _ = build_model_chunk(model_cfg, "fp32", seed=0, layout=layout)
    for name, param in model.named_parameters():
        param.copy_(take_shard(weights[model.global_param_name(name)], param))
    return model.eval()


def finish_grads(model, layout: ParallelLayout, tp_summed: Callable[[str], bool] = lambda name: False) -> None:
    """What megatron's DDP and finalize_model_grads add to backward: sums over CP ranks, and over TP
    ranks for the parameters each SP rank sees only its tokens' share of and those ``tp_summed`` names
    (a family's per-head q/k norms: each TP rank sees only its heads)."""
    for name, param in model.named_parameters():
        if layout.cp > 1:
            torch.distributed.all_reduce(param.grad, group=parallel_state.get_context_parallel_group())
        if layout.tp > 1 and (tp_summed(name) or (layout.sp and getattr(param, "sequence_parallel", False))):
            torch.distributed.all_reduce(param.grad, group=parallel_state.get_tensor_model_parallel_group())


def grad_error(model, expected: dict, floor: float = 0.0) -> float:
    """max over parameters of |grad - expected (this rank's shard)| / max(floor, max |expected|);
    ``expected``: {global name: full gradient}."""
    errors = []
    for name, param in model.named_parameters():
        reference = take_shard(expected[model.global_param_name(name)], param)
        errors.append(((param.grad - reference).abs().max() / max(floor, float(reference.abs().max()))).item())
    return max(errors)


def pipelined_forward(model, forward: Callable[[], torch.Tensor], hidden_shape: tuple[int, ...]):
    """PP=2 as the pipeline schedule hands over: stage 0 sends ``forward()``'s hidden (-> None), stage 1
    receives one of ``hidden_shape`` as its input and returns ``forward()``'s output."""
    if parallel_state.is_pipeline_first_stage():
        torch.distributed.send(forward().contiguous(), dst=1)
        return None
    hidden = torch.empty(hidden_shape)
    torch.distributed.recv(hidden, src=0)
    model.set_input_tensor(hidden)
    return forward()


def write_results(out_dir: Path, results: dict) -> None:
    """OUT_DIR/rank<R>.json, then the process group is torn down."""
    (Path(out_dir) / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(results))
    destroy_distributed()
