"""dfm's HunyuanVideo 1.5 at TP=2 + SP, CP=2 and PP=2 against diffusers, in one launch of 2 gloo ranks.

Usage: torchrun --nproc-per-node 2 _layouts_worker.py OUT_DIR. Every rank builds the same tiny
diffusers model and the per-sample references (outputs and, for one upstream gradient, every
parameter's gradient), then for each layout re-initialises megatron's parallel state, builds its
shard of the dfm model from the converted full weights, runs the mixed t2v / i2v pack and writes
the max abs diff of the outputs it holds (and of its gradients, relative) to OUT_DIR/rank<R>.json.
"""

import dataclasses
import functools
import sys
from pathlib import Path

import torch

from dfm.convert.flux import per_sample_max_abs_diff
from dfm.convert.hunyuan import diffusers_inputs, hunyuan_rules, verification_pack
from dfm.convert.rules import to_dfm
from dfm.data.patchify import patchify
from dfm.models.hunyuan.text_stream import text_stream_plan
from dfm.platform.distributed import initialize_distributed
from dfm.platform.process_exit import skip_final_gc_at_exit
from tests import _layouts_rank as ranks
from tests.hunyuan._tiny import dfm_config_and_weights, tiny_diffusers_hunyuan


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


def weighted_sum(weights: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return (out * weights).sum()


def text_and_video_rows(batch) -> int:
    """Rows of the hidden stage 0 hands stage 1: the text stream's then the pack's."""
    return int(text_stream_plan(batch, 1).cu_padded[-1]) + batch.seq_len


def main(out_dir: Path) -> None:
    initialize_distributed(ranks.LAYOUTS["tp2_sp"])
    reference = tiny_diffusers_hunyuan()
    cfg, weights = dfm_config_and_weights(reference)
    batch, c_noise = verification_pack(cfg.model)
    gen = torch.Generator().manual_seed(3)
    upstream = [torch.randn(n, cfg.model.in_channels, generator=gen) for n in batch.host_sample_lengths()]
    expected_outputs, grads = references(reference, batch, c_noise, upstream)
    expected_grads = to_dfm(grads, hunyuan_rules(cfg.model))
    results = {}
    for name, layout in ranks.LAYOUTS.items():
        ranks.enter_layout(layout)
        model_cfg = dataclasses.replace(cfg.model, **layout.config_values())
        model = ranks.sharded_model(model_cfg, layout, weights)
        batch, c_noise = verification_pack(model_cfg, padding=layout.padding_multiples())
        if layout.pp > 1:
            with torch.no_grad():
                shape = (text_and_video_rows(batch), 1, model_cfg.hidden_size)
                out = ranks.pipelined_forward(model, functools.partial(model, batch.latents, c_noise, batch), shape)
            if out is not None:
                results[name] = max(per_sample_max_abs_diff(out, expected_outputs, batch))
            continue
        model = ranks.with_grad_buffers(model)
        forward = functools.partial(model, batch.latents, c_noise, batch)
        out = ranks.forward_backward(model, forward, functools.partial(weighted_sum, packed(upstream, batch)))
        results[name] = max(per_sample_max_abs_diff(out, expected_outputs, batch))
        results[f"{name}/grad"] = ranks.grad_error(model, expected_grads, floor=1.0)
    ranks.write_results(out_dir, results)


if __name__ == "__main__":
    skip_final_gc_at_exit()
    main(Path(sys.argv[1]))
