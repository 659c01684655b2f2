"""What the per-family ``_layouts_worker.py`` scripts share on each rank (tests/_layouts.py launches
them and checks what they write): megatron's parallel state per layout, a model's shard of the full
weights, a backward through megatron's schedule, DDP and finalize_model_grads as the trainer runs one,
the pipeline's hand-over between two stages, and the per-rank results file."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func

from dfm.config.container import DDPConfig
from dfm.models.build import build_model_chunk
from dfm.models.common.init import take_shard
from dfm.parallel import ParallelLayout
from dfm.platform.distributed import destroy_distributed
from dfm.training.setup import megatron_ddp_config

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


def with_grad_buffers(model):
    """``model`` under megatron's DDP as the trainer wraps it (dfm.training.setup: its DDP config from
    the config defaults), so backward accumulates into the grad buffers ``forward_backward`` reduces."""
    ddp_config = megatron_ddp_config(SimpleNamespace(ddp=DDPConfig()), torch.device("cpu"))
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def forward_backward(model, forward: Callable[[], torch.Tensor], objective: Callable[[torch.Tensor], torch.Tensor]):
    """One micro-batch as dfm's trainer runs a step (dfm.training.pretrain.train_step): megatron's schedule
    calls ``forward()`` (-> output), differentiates ``objective(output)`` with the scaling it applies (x CP
    size, / micro-batches), then the config's finalize_model_grads (dfm.training.setup): grad sync over
    DP x CP, the reductions over TP (sequence-parallel parameters, per-head q/k norms) and PP. No
    reduction here is the test's own: one the trainer misses fails ``grad_error``. -> the output, detached."""
    model.config.finalize_model_grads_func = finalize_model_grads
    outputs = []

    def forward_step(_data, _model):
        output = forward()
        outputs.append(output.detach())
        return output, lambda out: (objective(out), {})

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([None]),
        model=[model],
        num_microbatches=1,
        seq_length=1,
        micro_batch_size=1,
        forward_only=False,
    )
    return outputs[0]


def grad_error(model, expected: dict, floor: float = 0.0) -> float:
    """max over parameters of |grad - expected (this rank's shard)| / max(floor, max |expected|);
    ``expected``: {global name: full gradient}. Under DDP the gradient is the grad buffer's."""
    module = getattr(model, "module", model)
    errors = []
    for name, param in module.named_parameters():
        grad = param.main_grad if hasattr(param, "main_grad") else param.grad
        reference = take_shard(expected[module.global_param_name(name)], param)
        errors.append(((grad - reference).abs().max() / max(floor, float(reference.abs().max()))).item())
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
