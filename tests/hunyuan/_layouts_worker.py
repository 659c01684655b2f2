"""dfm's HunyuanVideo 1.5 at TP=2 + SP, CP=2 and PP=2 against diffusers, in one launch of 2 gloo ranks.

Usage: torchrun --nproc-per-node 2 _layouts_worker.py OUT_DIR. Every rank builds the same tiny
diffusers model and the per-sample references (outputs and, for one upstream gradient, every
parameter's gradient), then for each layout re-initialises megatron's parallel state, builds its
shard of the dfm model from the converted full weights, runs the mixed t2v / i2v pack and writes
the max abs diff of the outputs it holds (and of its gradients, relative) to OUT_DIR/rank<R>.json.
"""

import dataclasses
import json
import sys
from pathlib import Path

import torch
from megatron.core import parallel_state

from dfm.convert.flux import per_sample_max_abs_diff
from dfm.convert.hunyuan import diffusers_inputs, hunyuan_rules, verification_pack
from dfm.convert.rules import to_dfm
from dfm.data.patchify import patchify
from dfm.models.common.init import take_shard
from dfm.models.hunyuan.text_stream import text_stream_plan
from dfm.platform.distributed import destroy_distributed, initialize_distributed
from dfm.platform.process_exit import skip_final_gc_at_exit
from tests.hunyuan._tiny import dfm_config_and_weights, tiny_diffusers_hunyuan
from tests.wan._layouts_worker import LAYOUTS, sharded_model


def packed(per_sample: list, batch) -> torch.Tensor:
    """Per-sample rows [L_i, C] -> [S, C] at the pack's segments (padding rows 0)."""
    out = torch.zeros(batch.seq_len, per_sample[0].shape[1])
    for rows, start in zip(per_sample, batch.host_view().cu_seqlens_q_padded.tolist()):
        out[start : start + rows.shape[0]] = rows
    return out


def references(reference, batch, c_noise, upstream: list):
    """diffusers per sample: (outputs [L_i, C], {diffusers name: gradient of sum(out_i * upstream_i)})."""
    outputs = []
    for i in range(batch.num_samples):
        out = patchify(reference(**diffusers_inputs(batch, batch.latents, c_noise, i)).sample[0], 1, 1)[0]
        (out * upstream[i]).sum().backward()
        outputs.append(out.detach())
    # None: the last block's text-stream outputs reach no output.
    return outputs, {k: torch.zeros_like(p) if p.grad is None else p.grad for k, p in reference.named_parameters()}


def finish_grads(model, layout) -> None:
    """What megatron's DDP and finalize_model_grads add to backward: sums over CP ranks; over TP ranks
    for the SP-shared parameters and the per-head q/k norms (each TP rank sees only its heads)."""
    tp_group = parallel_state.get_tensor_model_parallel_group()
    for name, param in model.named_parameters():
        if layout.cp > 1:
            torch.distributed.all_reduce(param.grad, group=parallel_state.get_context_parallel_group())
        qk_norm = "q_layernorm" in name or "k_layernorm" in name
        if layout.tp > 1 and (qk_norm or (layout.sp and getattr(param, "sequence_parallel", False))):
            torch.distributed.all_reduce(param.grad, group=tp_group)


def grad_error(model, layout, expected) -> float:
    """max over parameters of |grad - diffusers' grad (this rank's shard)| / max(1, max |diffusers' grad|)."""
    finish_grads(model, layout)
    errors = []
    for name, param in model.named_parameters():
        reference = take_shard(expected[model.global_param_name(name)], param)
        errors.append(((param.grad - reference).abs().max() / max(1.0, float(reference.abs().max()))).item())
    return max(errors)


def pipelined_forward(model, model_cfg, batch, c_noise):
    """Stage 0 sends its hidden [T_text + S, 1, h] as the pipeline schedule would; stage 1 returns the output."""
    if parallel_state.is_pipeline_first_stage():
        torch.distributed.send(model(batch.latents, c_noise, batch).contiguous(), dst=1)
        return None
    text = int(text_stream_plan(batch, 1).cu_padded[-1])
    hidden = torch.empty(text + batch.seq_len, 1, model_cfg.hidden_size)
    torch.distributed.recv(hidden, src=0)
    model.set_input_tensor(hidden)
    return model(batch.latents, c_noise, batch)


def main(out_dir: Path) -> None:
    initialize_distributed(LAYOUTS["tp2_sp"])
    reference = tiny_diffusers_hunyuan()
    cfg, weights = dfm_config_and_weights(reference)
    batch, c_noise = verification_pack(cfg.model)
    gen = torch.Generator().manual_seed(3)
    upstream = [torch.randn(n, cfg.model.in_channels, generator=gen) for n in batch.host_sample_lengths()]
    expected_outputs, grads = references(reference, batch, c_noise, upstream)
    expected_grads = to_dfm(grads, hunyuan_rules(cfg.model))
    results = {}
    for name, layout in LAYOUTS.items():
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(**layout.megatron_parallel_kwargs())
        model_cfg = dataclasses.replace(cfg.model, **layout.config_values())
        model = sharded_model(model_cfg, layout, weights)
        batch, c_noise = verification_pack(model_cfg, padding=layout.padding_multiples())
        if layout.pp > 1:
            with torch.no_grad():
                out = pipelined_forward(model, model_cfg, batch, c_noise)
            if out is not None:
                results[name] = max(per_sample_max_abs_diff(out, expected_outputs, batch))
            continue
        out = model(batch.latents, c_noise, batch)
        results[name] = max(per_sample_max_abs_diff(out.detach(), expected_outputs, batch))
        (out * packed(upstream, batch)).sum().backward()
        results[f"{name}/grad"] = grad_error(model, layout, expected_grads)
    rank = torch.distributed.get_rank()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))
    destroy_distributed()


if __name__ == "__main__":
    skip_final_gc_at_exit()
    main(Path(sys.argv[1]))
