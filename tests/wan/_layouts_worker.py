"""dfm's Wan at TP=2 + SP, CP=2 and PP=2 against diffusers, in one launch of 2 gloo ranks.

Usage: torchrun --nproc-per-node 2 _layouts_worker.py OUT_DIR. Every rank builds the same tiny
diffusers Wan and the per-sample references (a mixed pack: two TI2V samples, their first
frame at timestep 0 per token, and a text-to-video one), then for each layout re-initialises megatron's
parallel state, builds its shard of the dfm model from the converted full weights, runs the pack
and writes the max abs diff of the outputs it holds to OUT_DIR/rank<R>.json. The same again for a
tiny Wan 2.2 I2V model (each token's image condition read beside its latent) at TP=2 + SP and CP=2,
its results named ``i2v/<layout>``.
"""

import json
import sys
from pathlib import Path

import torch
from megatron.core import parallel_state

from dfm.convert.rules import to_dfm
from dfm.convert.wan import (
    dfm_sample_outputs,
    diffusers_sample_output,
    max_abs_diff,
    parity_samples,
    parity_timesteps,
    rules,
)
from dfm.data.packing import pack_samples
from dfm.models.build import build_model_chunk
from dfm.models.common.init import take_shard
from dfm.parallel import ParallelLayout
from dfm.platform.distributed import destroy_distributed, initialize_distributed
from dfm.platform.process_exit import skip_final_gc_at_exit
from tests.wan._tiny import TEXT_LEN, TINY, TINY_I2V, tiny_diffusers_wan, tiny_model_config

# A mixed pack: samples 0 and 2 are Wan 2.2 TI2V ones (first frame clean, at timestep 0 per token).
MIXED = (True, False, True)
LAYOUTS = {
    "tp2_sp": ParallelLayout(world_size=2, tp=2, sp=True),
    "cp2": ParallelLayout(world_size=2, cp=2),
    "pp2": ParallelLayout(world_size=2, pp=2),
}
# result prefix -> (the tiny diffusers config, which samples are TI2V ones, the layouts run)
CASES = {"": (TINY, MIXED, tuple(LAYOUTS)), "i2v/": (TINY_I2V, (), ("tp2_sp", "cp2"))}


@torch.no_grad()
def sharded_model(cfg, layout, weights):
    model, _ = build_model_chunk(cfg, "fp32", seed=0, layout=layout)
    for name, param in model.named_parameters():
        param.copy_(take_shard(weights[model.global_param_name(name)], param))
    return model.eval()


def finish_grads(model, layout) -> None:
    """What megatron's DDP and finalize_model_grads add to backward: sums over CP ranks, and over TP
    ranks for the parameters each SP rank sees only its tokens' share of."""
    for param in model.parameters():
        if layout.cp > 1:
            torch.distributed.all_reduce(param.grad, group=parallel_state.get_context_parallel_group())
        if layout.sp and getattr(param, "sequence_parallel", False):
            torch.distributed.all_reduce(param.grad, group=parallel_state.get_tensor_model_parallel_group())


def grad_errors(model, layout, out, batch, cfg, upstream, expected) -> float:
    """max over parameters of |grad - diffusers' grad (as this rank's shard)| / max |diffusers' grad|."""
    outputs = dfm_sample_outputs(out, batch, cfg)
    sum((o * g).sum() for o, g in zip(outputs, upstream)).backward()
    finish_grads(model, layout)
    errors = []
    for name, param in model.named_parameters():
        reference = take_shard(expected[model.global_param_name(name)], param)
        errors.append(((param.grad - reference).abs().max() / reference.abs().max()).item())
    return max(errors)


def run_layout(layout, cfg, weights, samples, timesteps):
    """(the model, the pack's output [S, D] where this rank has it (None on a non-last pipeline
    stage), the pack); no autograd graph under PP."""
    model = sharded_model(cfg, layout, weights)
    batch = pack_samples(samples, *layout.padding_multiples())
    if layout.pp == 1:
        return model, model(batch.latents, timesteps, batch), batch
    with torch.no_grad():
        return (model, *pipelined_forward(model, cfg, batch, timesteps))


def pipelined_forward(model, cfg, batch, timesteps):
    if parallel_state.is_pipeline_first_stage():
        hidden = model(batch.latents, timesteps, batch)
        torch.distributed.send(hidden.contiguous(), dst=1)
        return None, batch
    hidden = torch.empty(batch.seq_len, 1, cfg.hidden_size)
    torch.distributed.recv(hidden, src=0)
    model.set_input_tensor(hidden)
    return model(batch.latents, timesteps, batch), batch


def case_results(config: dict, first_frame_clean, layouts) -> dict[str, float]:
    """{layout: output diff, layout/grad: gradient diff} of the tiny diffusers Wan of ``config``."""
    transformer = tiny_diffusers_wan(config=config)
    cfg = tiny_model_config(config)
    weights = to_dfm(transformer.state_dict(), rules(cfg))
    samples, timesteps = parity_samples(cfg, first_frame_clean=first_frame_clean), parity_timesteps(3)
    gen = torch.Generator().manual_seed(7)
    upstream = [torch.randn(s.latent_shape, generator=gen) for s in samples]
    references = [diffusers_sample_output(transformer, s, t, TEXT_LEN) for s, t in zip(samples, timesteps)]
    sum((r * g).sum() for r, g in zip(references, upstream)).backward()
    expected_grads = to_dfm({name: p.grad for name, p in transformer.named_parameters()}, rules(cfg))
    references = [r.detach() for r in references]
    results = {}
    for name in layouts:
        layout = LAYOUTS[name]
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(**layout.megatron_parallel_kwargs())
        layout_cfg = tiny_model_config(config, **layout.config_values())
        model, out, batch = run_layout(layout, layout_cfg, weights, samples, timesteps)
        if out is None:
            continue
        results[name] = max_abs_diff(dfm_sample_outputs(out.detach(), batch, cfg), references)
        if layout.pp == 1:
            results[f"{name}/grad"] = grad_errors(model, layout, out, batch, cfg, upstream, expected_grads)
    return results


def main(out_dir: Path) -> None:
    initialize_distributed(LAYOUTS["tp2_sp"])
    results = {}
    for prefix, case in CASES.items():
        results.update({prefix + name: value for name, value in case_results(*case).items()})
    rank = torch.distributed.get_rank()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))
    destroy_distributed()


if __name__ == "__main__":
    skip_final_gc_at_exit()
    main(Path(sys.argv[1]))
