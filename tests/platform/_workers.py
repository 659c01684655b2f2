"""Scenarios for tests/platform/test_device_layer.py, each run in a fresh process (or two).

Usage: python _workers.py {single|pair} OUT_DIR   (RANK/WORLD_SIZE set by the launcher)

Every scenario returns a dict of tensors/numbers; the results of all scenarios of a launch are
saved to OUT_DIR/<launch>_rank<R>.pt, and a failing scenario records its traceback instead,
so one broken site does not hide the others. The `__main__` guard is required: megatron's
checkpoint writer spawns a multiprocessing Manager, which re-imports this file.
"""

import functools
import os
import re
import sys
import traceback

import torch

from dfm.platform.process_exit import skip_final_gc_at_exit

SEED = 1234
VOCAB, SEQ, MICRO_BATCH, HIDDEN, HEADS = 64, 16, 2, 32, 4
TRAIN_STEPS = 4


# ---------------------------------------------------------------- model and data helpers


def tiny_config(tp=1, pp=1, sp=False, ep=1, num_experts=None, num_layers=2):
    from megatron.core.transformer import TransformerConfig

    moe = {}
    if num_experts:
        moe = dict(
            num_moe_experts=num_experts,
            moe_router_topk=2,
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=False,
            moe_aux_loss_coeff=0.0,
            expert_model_parallel_size=ep,
            add_bias_linear=False,
        )
    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=4 * HIDDEN,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,  # master weights from the CPU RNG: the same for any TP
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sp,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32 if pp > 1 else None,
        **moe,
    )


def tiny_gpt(config, pre_process=True, post_process=True):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=False,
    )


def tiny_block(config, num_experts=None):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlock

    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False)
    return TransformerBlock(config, spec)


def micro_batch(index):
    """Micro-batch number `index` of the global stream: a function of (SEED, index) only."""
    gen = torch.Generator().manual_seed(SEED * 1000 + index)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=gen)
    return {
        "tokens": tokens[:, :-1],
        "labels": tokens[:, 1:],
        "position_ids": torch.arange(SEQ).expand(MICRO_BATCH, SEQ),
        "loss_mask": torch.ones(MICRO_BATCH, SEQ),
    }


def loss_func(loss_mask, output_tensor):
    loss = (output_tensor.float() * loss_mask).sum() / loss_mask.sum()
    # clone: the schedule divides the returned loss in place by the number of micro-batches
    return loss, {"loss": loss.detach().clone()}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, functools.partial(loss_func, batch["loss_mask"])


def wrap_ddp_and_optimizer(model, use_distributed_optimizer=False, lr=1e-2):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=use_distributed_optimizer
    )
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.no_sync_func = ddp.no_sync
    opt_config = OptimizerConfig(
        optimizer="adam", lr=lr, clip_grad=1.0, use_distributed_optimizer=use_distributed_optimizer
    )
    return ddp, get_megatron_optimizer(opt_config, [ddp])


def train(ddp, optimizer, batch_indices_per_step):
    """Run megatron's schedule + optimizer; return per-step mean losses and grad norms."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    losses, grad_norms = [], []
    for indices in batch_indices_per_step:
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        out = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([micro_batch(i) for i in indices]),
            model=[ddp],
            num_microbatches=len(indices),
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
        )
        _, grad_norm, _ = optimizer.step()
        grad_norms.append(float(grad_norm))
        losses.append(float(torch.stack([o["loss"] for o in out]).mean()) if out else None)
    return losses, grad_norms


def full_state(module):
    """Parameters with tensor-parallel shards gathered to their full (TP=1) shape."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    world = parallel_state.get_tensor_model_parallel_world_size()
    state = {}
    for name, param in module.named_parameters():
        state[name] = _gather_tp(param.detach(), param, group, world)
    return state


def full_grads(module):
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    world = parallel_state.get_tensor_model_parallel_world_size()
    return {
        name: _gather_tp(param.main_grad.detach().clone(), param, group, world)
        for name, param in module.named_parameters()
    }


def _layout(**sizes):
    """The parallel layout of ``sizes`` on the ranks torchrun started."""
    from dfm.parallel import ParallelLayout, launched_world_size

    return ParallelLayout(world_size=launched_world_size(), **sizes)


def _gather_tp(tensor, param, group, world):
    if world == 1 or not getattr(param, "tensor_model_parallel", False):
        return tensor.clone()
    parts = [torch.empty_like(tensor) for _ in range(world)]
    torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=param.partition_dim)


def _cloned_state_dict(module):
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in module.state_dict().items()}


def load_renumbered(module, full_state_dict, rename):
    """Load a full state dict into `module` whose keys map to it through `rename`."""
    own = module.state_dict()
    module.load_state_dict({key: full_state_dict[rename(key)] for key in own}, strict=True)


# ---------------------------------------------------------------- scenarios


def scenario_train_gpt(results):
    """P1 (world 1): schedule + DDP + Adam with clip_grad; also the DP=1 and PP=1 references."""
    from dfm.platform import initialize_distributed

    initialize_distributed(seed=SEED)
    torch.manual_seed(SEED)
    model = tiny_gpt(tiny_config())
    results["gpt_initial_state"] = _cloned_state_dict(model)
    ddp, optimizer = wrap_ddp_and_optimizer(model)
    # Two micro-batches per step, the same each step so the loss must fall: the global batch
    # that DP=2 and PP=2 split differently.
    losses, grad_norms = train(ddp, optimizer, [[0, 1]] * TRAIN_STEPS)
    results["gpt_losses"] = losses
    results["gpt_grad_norms"] = grad_norms
    results["gpt_final_params"] = {n: p.detach().clone() for n, p in model.named_parameters()}


def scenario_rng_tracker(results):
    """The TP RNG tracker forks a reproducible stream distinct from the default one."""
    from megatron.core import tensor_parallel

    from dfm.platform import initialize_distributed, seed_everything

    initialize_distributed(seed=SEED)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        forked = torch.rand(4)
    default_after_fork = torch.rand(4)
    seed_everything(SEED)  # replaces the tracker
    with tensor_parallel.get_cuda_rng_tracker().fork():
        forked_again = torch.rand(4)
    default_again = torch.rand(4)
    results["rng"] = {
        "forked": forked,
        "forked_again": forked_again,
        "default": default_after_fork,
        "default_again": default_again,
    }


def scenario_block_reference(results):
    """P2 reference: TP=1 block output and grads."""
    _run_block(results, tp=1, sp=False, key="block_tp1")


def _run_block(results, tp, sp, key):
    from _torch_norm_sp import TORCH_NORM_SEQUENCE_PARALLEL
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads

    from dfm.platform import initialize_distributed
    from dfm.platform.compat import patches_applied

    initialize_distributed(_layout(tp=tp), seed=SEED)
    torch.manual_seed(SEED)
    with patches_applied([TORCH_NORM_SEQUENCE_PARALLEL]):
        block = tiny_block(tiny_config(tp=tp, sp=sp))
    ddp, _ = wrap_ddp_and_optimizer(block)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(SEQ, MICRO_BATCH, HIDDEN, generator=gen)
    weight = torch.randn(SEQ, MICRO_BATCH, HIDDEN, generator=gen)
    rank = parallel_state.get_tensor_model_parallel_rank()
    if sp:  # each TP rank holds its slice of the sequence
        x, weight = x.chunk(tp)[rank], weight.chunk(tp)[rank]
    out = ddp(x, attention_mask=None)
    (out * weight).sum().backward()
    finalize_model_grads([ddp])
    if sp:
        parts = [torch.empty_like(out) for _ in range(tp)]
        torch.distributed.all_gather(
            parts, out.detach().contiguous(), group=parallel_state.get_tensor_model_parallel_group()
        )
        out = torch.cat(parts)
    results[key] = {
        "output": out.detach().clone(),
        "params": full_state(block),
        "grads": full_grads(block),
    }
    parallel_state.destroy_model_parallel()


def scenario_moe_reference(results):
    """P6 (world 1): MoE block forward/backward; outputs for both EP ranks' inputs."""
    _run_moe(results, ep=1, key="moe_ep1")


def _moe_input(index):
    gen = torch.Generator().manual_seed(100 + index)
    return torch.randn(SEQ, MICRO_BATCH, HIDDEN, generator=gen)


def _run_moe(results, ep, key, reference_state=None):
    from megatron.core import parallel_state

    from dfm.platform import initialize_distributed

    initialize_distributed(_layout(ep=ep), seed=SEED)
    torch.manual_seed(SEED)
    num_experts = 4
    block = tiny_block(tiny_config(ep=ep, num_experts=num_experts), num_experts=num_experts)
    if reference_state is not None:
        ep_rank = parallel_state.get_expert_model_parallel_rank()
        local = num_experts // ep
        load_renumbered(block, reference_state, _expert_renamer(ep_rank * local))
    rank = torch.distributed.get_rank()
    inputs = [rank] if ep > 1 else list(range(2))
    outputs, grads = {}, {}
    for index in inputs:
        block.zero_grad()
        x = _moe_input(index).requires_grad_(True)
        out = block(x, attention_mask=None)
        out.square().mean().backward()
        outputs[index] = out.detach().clone()
        grads[index] = x.grad.clone()
    results[key] = {
        "outputs": outputs,
        "input_grads": grads,
        "state": _cloned_state_dict(block),
    }
    parallel_state.destroy_model_parallel()


def _expert_renamer(offset):

    def rename(key):
        return re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{int(m.group(1)) + offset}.", key)

    return rename


def scenario_block_tp2(results):
    """P2: TP=2 without and with sequence parallelism."""
    _run_block(results, tp=2, sp=False, key="block_tp2")
    _run_block(results, tp=2, sp=True, key="block_tp2_sp")


def scenario_dp2_distributed_optimizer(results, reference):
    """P3: DP=2 with the distributed optimizer, one micro-batch of the global batch per rank."""
    from megatron.core import parallel_state

    from dfm.platform import initialize_distributed

    initialize_distributed(seed=SEED)
    model = tiny_gpt(tiny_config())
    model.load_state_dict(reference["gpt_initial_state"])
    ddp, optimizer = wrap_ddp_and_optimizer(model, use_distributed_optimizer=True)
    rank = torch.distributed.get_rank()
    _, grad_norms = train(ddp, optimizer, [[rank]] * TRAIN_STEPS)
    results["dp2_grad_norms"] = grad_norms
    results["dp2_final_params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    parallel_state.destroy_model_parallel()


def scenario_pp2(results, reference):
    """P4: PP=2 with forward_backward_pipelining_without_interleaving over gloo p2p."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_pipelining_without_interleaving,
    )

    from dfm.platform import initialize_distributed

    initialize_distributed(_layout(pp=2), seed=SEED)
    assert get_forward_backward_func() is forward_backward_pipelining_without_interleaving
    stage = parallel_state.get_pipeline_model_parallel_rank()
    config = tiny_config(pp=2)
    model = tiny_gpt(config, pre_process=stage == 0, post_process=stage == 1)
    offset = stage  # one layer per stage
    load_renumbered(model, reference["gpt_initial_state"], _layer_renamer(offset))
    ddp, optimizer = wrap_ddp_and_optimizer(model)
    losses, grad_norms = train(ddp, optimizer, [[0, 1]] * TRAIN_STEPS)
    results["pp2_losses"] = losses
    results["pp2_grad_norms"] = grad_norms
    parallel_state.destroy_model_parallel()


def _layer_renamer(offset):

    def rename(key):
        return re.sub(r"layers\.(\d+)\.", lambda m: f"layers.{int(m.group(1)) + offset}.", key)

    return rename


def scenario_moe_ep2(results, reference):
    """P6: MoE with EP=2 (alltoall dispatcher) reproduces EP=1 outputs and input grads."""
    _run_moe(results, ep=2, key="moe_ep2", reference_state=reference["moe_ep1"]["state"])


def scenario_dist_checkpoint(results, out_dir):
    """P5: dist_checkpointing save at TP=2, load back at TP=2 and resharded at TP=1."""
    from megatron.core import dist_checkpointing, parallel_state

    from dfm.platform import initialize_distributed

    ckpt_dir = os.path.join(out_dir, "ckpt")
    initialize_distributed(_layout(tp=2), seed=SEED)
    torch.manual_seed(SEED)
    model = tiny_gpt(tiny_config(tp=2))
    saved = full_state(model)
    if torch.distributed.get_rank() == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)

    torch.manual_seed(SEED + 1)  # different init, so a no-op load would show
    same_layout = tiny_gpt(tiny_config(tp=2))
    same_layout.load_state_dict(dist_checkpointing.load(same_layout.sharded_state_dict(), ckpt_dir))
    results["ckpt_saved"] = saved
    results["ckpt_loaded_tp2"] = full_state(same_layout)
    parallel_state.destroy_model_parallel()

    initialize_distributed(_layout(tp=1), seed=SEED)
    torch.manual_seed(SEED + 2)
    resharded = tiny_gpt(tiny_config(tp=1))
    resharded.load_state_dict(dist_checkpointing.load(resharded.sharded_state_dict(), ckpt_dir))
    results["ckpt_loaded_tp1"] = full_state(resharded)
    parallel_state.destroy_model_parallel()


# ---------------------------------------------------------------- launches


def run_single(out_dir):
    results = {}
    _run_scenarios(
        results,
        [
            scenario_train_gpt,
            scenario_rng_tracker,
            scenario_block_reference,
            scenario_moe_reference,
        ],
    )
    return results


def run_pair(out_dir):
    reference = torch.load(os.path.join(out_dir, "single_rank0.pt"), weights_only=False)
    results = {}
    _run_scenarios(
        results,
        [
            scenario_block_tp2,
            functools.partial(scenario_dp2_distributed_optimizer, reference=reference),
            functools.partial(scenario_pp2, reference=reference),
            functools.partial(scenario_moe_ep2, reference=reference),
            functools.partial(scenario_dist_checkpoint, out_dir=out_dir),
        ],
    )
    return results


def _run_scenarios(results, scenarios):
    from megatron.core import parallel_state

    for scenario in scenarios:
        name = getattr(scenario, "__name__", None) or scenario.func.__name__
        try:
            scenario(results)
        except Exception:
            results[f"error:{name}"] = traceback.format_exc()
            print(results[f"error:{name}"], file=sys.stderr, flush=True)
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()


def main():
    launch, out_dir = sys.argv[1], sys.argv[2]
    results = {"single": run_single, "pair": run_pair}[launch](out_dir)
    rank = int(os.environ.get("RANK", "0"))
    torch.save(results, os.path.join(out_dir, f"{launch}_rank{rank}.pt"))
    from dfm.platform import destroy_distributed

    destroy_distributed()


if __name__ == "__main__":
    skip_final_gc_at_exit()
    main()
