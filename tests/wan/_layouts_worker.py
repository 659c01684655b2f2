"""dfm's Wan at TP=2 + SP, CP=2 and PP=2 against diffusers, in one launch of 2 gloo ranks.

Usage: torchrun --nproc-per-node 2 _layouts_worker.py OUT_DIR. Every rank builds the same tiny
diffusers Wan and the per-sample references (a mixed pack: two TI2V samples, their first
frame at timestep 0 per token, and a text-to-video one), then for each layout re-initialises megatron's
parallel state, builds its shard of the dfm model from the converted full weights, runs the pack
and writes the max abs diff of the outputs it holds to OUT_DIR/rank<R>.json. The same again for a
tiny Wan 2.2 I2V model (each token's image condition read beside its latent) at TP=2 + SP and CP=2,
its results named ``i2v/<layout>``.
"""

import sys
from pathlib import Path

import torch

from dfm.convert.rules import to_dfm
from dfm.convert.wan import dfm_sample_outputs, max_abs_diff, parity_samples, parity_timesteps, rules
from dfm.data.packing import pack_samples
from dfm.platform.distributed import initialize_distributed
from dfm.platform.process_exit import skip_final_gc_at_exit
from tests import _layouts_rank as ranks
from tests.wan._tiny import TINY, TINY_I2V, diffusers_reference, tiny_diffusers_wan, tiny_model_config

# A mixed pack: samples 0 and 2 are Wan 2.2 TI2V ones (first frame clean, at timestep 0 per token).
MIXED = (True, False, True)
# result prefix -> (the tiny diffusers config, which samples are TI2V ones, the layouts run)
CASES = {"": (TINY, MIXED, tuple(ranks.LAYOUTS)), "i2v/": (TINY_I2V, (), ("tp2_sp", "cp2"))}


def run_layout(layout, cfg, weights, samples, timesteps, upstream):
    """(the pack's output [S, D] where this rank has it (None on a non-last pipeline stage), the pack,
    the model). Without PP, one step's backward of sum(output_i * upstream_i) as the trainer runs it."""
    model = ranks.sharded_model(cfg, layout, weights)
    batch = pack_samples(samples, *layout.padding_multiples())
    if layout.pp == 1:
        model = ranks.with_grad_buffers(model)
        objective = lambda out: sum((o * g).sum() for o, g in zip(dfm_sample_outputs(out, batch, cfg), upstream))  # noqa: E731
        out = ranks.forward_backward(model, lambda: model(batch.latents, timesteps, batch), objective)
        return out, batch, model
    with torch.no_grad():
        out = ranks.pipelined_forward(
            model, lambda: model(batch.latents, timesteps, batch), (batch.seq_len, 1, cfg.hidden_size)
        )
    return out, batch, model


def case_results(config: dict, first_frame_clean, layouts) -> dict[str, float]:
    """{layout: output diff, layout/grad: gradient diff} of the tiny diffusers Wan of ``config``."""
    transformer = tiny_diffusers_wan(config=config)
    cfg = tiny_model_config(config)
    weights = to_dfm(transformer.state_dict(), rules(cfg))
    samples, timesteps = parity_samples(cfg, first_frame_clean=first_frame_clean), parity_timesteps(3)
    reference = diffusers_reference(transformer, samples, timesteps)
    expected_grads = to_dfm(reference.grads, rules(cfg))
    results = {}
    for name in layouts:
        layout = ranks.LAYOUTS[name]
        ranks.enter_layout(layout)
        layout_cfg = tiny_model_config(config, **layout.config_values())
        out, batch, model = run_layout(layout, layout_cfg, weights, samples, timesteps, reference.upstream)
        if out is None:
            continue
        results[name] = max_abs_diff(dfm_sample_outputs(out, batch, cfg), reference.outputs)
        if layout.pp == 1:
            results[f"{name}/grad"] = ranks.grad_error(model, expected_grads)
    return results


def main(out_dir: Path) -> None:
    initialize_distributed(ranks.LAYOUTS["tp2_sp"])
    results = {}
    for prefix, case in CASES.items():
        results.update({prefix + name: value for name, value in case_results(*case).items()})
    ranks.write_results(out_dir, results)


if __name__ == "__main__":
    skip_final_gc_at_exit()
    main(Path(sys.argv[1]))
