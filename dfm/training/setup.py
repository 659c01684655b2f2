"""Build the pieces of a training run: model chunks (DDP-wrapped), optimizer, LR schedule, data."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from dfm.config.container import ConfigContainer
from dfm.config.validate import micro_batches_per_step
from dfm.models.build import build_meta_chunk, build_model_chunk
from dfm.models.common.fp8_linear import fp8_coverage
from dfm.models.common.materialise import defer_to_fsdp, init_fsdp_shards
from dfm.models.common.sample_classifier import add_classifier
from dfm.parallel.layout import ParallelLayout
from dfm.platform.distributed import alone
from dfm.platform.optimizer_steps import step_parameters_together
from dfm.training.buffer_grads import accumulate_into_buffers, skip_sync_alone

logger = logging.getLogger("dfm.train")


@dataclass
class TrainState:
    model: list[Any]  # DDP-wrapped model chunks (one per virtual pipeline stage)
    optimizer: Any
    scheduler: OptimizerParamScheduler
    transformer_config: Any


def num_microbatches(cfg: ConfigContainer, layout: ParallelLayout) -> int:
    return micro_batches_per_step(cfg.train, layout)


def build_model(
    cfg: ConfigContainer, layout: ParallelLayout, device: torch.device, classifier: bool = False
) -> tuple[list[Any], Any]:
    """Wrapped model chunks on ``device`` (DDP, or Megatron-FSDP with ``ddp.use_megatron_fsdp``) and
    the megatron TransformerConfig they share. Built on the meta device: a rank only ever allocates
    and initialises what it owns (its TP/PP-local parameters, under FSDP its rows of them).
    ``classifier``: with a GAN classifier (a distillation's critic with the GAN loss on)."""
    ddp_config = megatron_ddp_config(cfg, device)
    if cfg.ddp.use_megatron_fsdp:
        chunks, tconfig = fully_sharded_chunks(cfg, layout, ddp_config, device, classifier)
        log_fp8_coverage(cfg, chunks)
        return chunks, tconfig
    chunks, tconfig = [], None
    for vp_stage in vp_stages(layout):
        # bf16/fp16 runs: the plain nn.Linear embedders and final layer too (as megatron's Float16Module
        # does), so no fp32 activation meets a low-precision weight; fp32 runs are unchanged.
        chunk, tconfig = build_model_chunk(
            cfg.model,
            cfg.mixed_precision.precision,
            cfg.rng.seed,
            vp_stage,
            layout,
            device,
            params_dtype_everywhere=True,
            fp8=cfg.mixed_precision.fp8,
        )
        chunks.append(with_extras(chunk, cfg, classifier))
    wrapped = [
        DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]
    log_fp8_coverage(cfg, chunks)
    for chunk in wrapped:
        chunk.broadcast_params()
        chunk.buffer_grad_params = accumulate_into_buffers(chunk, ddp_config, tconfig)  # buffer_grads.py
        skip_sync_alone(chunk)
    return wrapped, tconfig


def log_fp8_coverage(cfg: ConfigContainer, chunks) -> None:
    """Rank 0, with ``mixed_precision.fp8``: how many linears run their products in FP8, which keep theirs."""
    if cfg.mixed_precision.fp8 is None or torch.distributed.get_rank() != 0:
        return
    in_fp8, kept = fp8_coverage(chunks)
    logger.info(
        "mixed_precision.fp8=%s: %d linears' products in FP8; %d keep %s (adaLN rows, sizes off 16): %s; "
        "MoE experts, embedders and the head keep it too",
        cfg.mixed_precision.fp8,
        len(in_fp8),
        len(kept),
        cfg.mixed_precision.precision,
        ", ".join(kept[:8]) + (" ..." if len(kept) > 8 else ""),
    )


def with_adapters(chunk, cfg: ConfigContainer):
    """``chunk`` with LoRA adapters on its targeted linears and its base frozen (dfm/peft), when
    ``peft.lora_rank`` > 0: before DDP / FSDP wrap it, so only trainable parameters get gradient
    buffers and optimizer state."""
    if cfg.peft.enabled:
        from dfm.convert.lora import family_rules
        from dfm.peft.inject import add_lora

        add_lora(chunk, cfg.peft, cfg.model, family_rules(cfg.model), cfg.rng.seed, cfg.model.init_method_std)
    return chunk


def with_extras(chunk, cfg: ConfigContainer, classifier: bool):
    """``chunk`` with what a run adds to the model before it is wrapped: LoRA adapters (``with_adapters``)
    and, for a distillation's critic with the GAN loss, the classifier (sample_classifier.py)."""
    chunk = with_adapters(chunk, cfg)
    return add_classifier(chunk, cfg.rng.seed, cfg.model.init_method_std) if classifier else chunk


def vp_stages(layout: ParallelLayout) -> list[int | None]:
    return list(range(layout.chunks_per_stage)) if layout.chunks_per_stage > 1 else [None]


def fully_sharded_chunks(
    cfg: ConfigContainer, layout: ParallelLayout, ddp_config, device: torch.device, classifier: bool = False
):
    """Meta chunks handed to Megatron-FSDP, which allocates this rank's shards (and, one FSDP unit at
    a time, the gathered weights: as in every forward), then this rank's rows are drawn into them."""
    chunks, tconfig = [], None
    for index, vp_stage in enumerate(vp_stages(layout)):
        meta, tconfig = build_meta_chunk(
            cfg.model,
            cfg.mixed_precision.precision,
            vp_stage,
            layout,
            params_dtype_everywhere=True,
            device=device,
            fp8=cfg.mixed_precision.fp8,
        )
        tconfig.init_model_with_meta_device = True
        chunk = fully_sharded(defer_to_fsdp(with_extras(meta, cfg, classifier)), tconfig, ddp_config, device, index > 0)
        init_fsdp_shards(chunk, cfg.rng.seed, meta.global_param_name, cfg.model.init_method_std)
        chunks.append(chunk)
    return chunks, tconfig


def megatron_ddp_config(cfg: ConfigContainer, device: torch.device) -> DistributedDataParallelConfig:
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=cfg.ddp.grad_reduce_in_fp32,
        overlap_grad_reduce=cfg.ddp.overlap_grad_reduce,
        overlap_param_gather=cfg.ddp.overlap_param_gather,
        use_distributed_optimizer=uses_distributed_optimizer(cfg),
        average_in_collective=cfg.ddp.average_in_collective,
        use_megatron_fsdp=cfg.ddp.use_megatron_fsdp,
        data_parallel_sharding_strategy=cfg.ddp.data_parallel_sharding_strategy,
        # Scaling fused into the reduction is NCCL's PREMUL_SUM, which gloo lacks.
        gradient_reduce_div_fusion=device.type == "cuda",
    )


def uses_distributed_optimizer(cfg: ConfigContainer) -> bool:
    """Megatron-FSDP steps through megatron's distributed optimizer (over its DTensor shards)."""
    return cfg.ddp.use_distributed_optimizer or cfg.ddp.use_megatron_fsdp


def fully_sharded(chunk, tconfig, ddp_config, device: torch.device, disable_bucketing: bool):
    """One chunk under Megatron-FSDP. With parameters sharded, each transformer block is one unit
    whose weights are gathered just before it runs and freed after."""
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    from dfm.peft.fsdp import frozen_params_without_grad_hooks

    shards_params = ddp_config.data_parallel_sharding_strategy == "optim_grads_params"
    units = sorted({type(layer) for layer in chunk.layers}, key=lambda cls: cls.__name__) if shards_params else []
    if units:
        ddp_config = dataclasses.replace(ddp_config, suggested_communication_unit_size=two_units(chunk))
    # No broadcast_params(): megatron's broadcasts a DTensor, which c10d rejects; the layout-independent
    # init (dfm.models.common.init) already gives every DP rank the same weights.
    with frozen_params_without_grad_hooks():  # a LoRA run's frozen base (dfm/peft/fsdp.py)
        return FullyShardedDataParallel(
            config=tconfig,
            ddp_config=ddp_config,
            module=chunk,
            fsdp_unit_modules=units,
            disable_bucketing=disable_bucketing,
            device=device,
        )


def two_units(chunk) -> int:
    """Elements of two transformer blocks: what Megatron-FSDP may hold gathered (the running unit and
    the prefetched next one) and queue for reduce-scatter. Its own default is at least 1e9 elements
    (prefetch 5e8): every unit of a model below 0.5B parameters gathered at once, and every unsharded
    gradient queued until the end of the backward, i.e. per rank the whole model, whatever the DP."""
    return 2 * max(sum(p.numel() for p in layer.parameters()) for layer in chunk.layers)


def schedule_model_and_data(model: list[Any], data_iter) -> dict[str, Any]:
    """megatron schedule arguments ``model`` and ``data_iterator``: the one chunk and its iterator,
    or (interleaved virtual pipeline) all chunks, each with its own view of one batch stream,
    since every chunk reads every micro-batch (each stage needs the pack's segments)."""
    if len(model) == 1:
        return {"model": model[0], "data_iterator": data_iter}
    return {"model": model, "data_iterator": list(itertools.tee(data_iter, len(model)))}


def finalize_alone(model: list[Any], num_tokens: torch.Tensor | None = None, **kwargs) -> None:
    """megatron's ``finalize_model_grads`` on a one-process job without MoE: every reduction it makes is
    over a group of one and no router state needs updating, so only the chunks' own grad sync is left
    (DDP's is skipped alone, ``skip_sync_alone``); ~0.3 ms of its checks a step on the CPU. A token count
    to scale by goes to megatron's."""
    if num_tokens is not None:
        finalize_model_grads(model, num_tokens, **kwargs)
        return
    for chunk in model:
        chunk.finish_grad_sync()


def build_optimizer(cfg: ConfigContainer, model: list[Any], tconfig) -> tuple[Any, OptimizerParamScheduler]:
    o = cfg.optimizer
    precision = cfg.mixed_precision.precision
    opt_config = OptimizerConfig(
        optimizer=o.optimizer,
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        clip_grad=o.clip_grad,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        params_dtype=tconfig.params_dtype,
        use_distributed_optimizer=uses_distributed_optimizer(cfg),
    )
    optimizer = get_megatron_optimizer(opt_config, model)
    step_parameters_together(optimizer)
    s = cfg.scheduler
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if s.lr_warmup_iters else o.lr,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=s.lr_warmup_iters,
        lr_decay_steps=s.decay_iters(cfg.train.train_iters),
        lr_decay_style=s.lr_decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=cfg.train.train_iters,
        wd_incr_style="constant",
    )
    # The schedules call these hooks: grad sync + SP/PP reductions, and loss scaling.
    tconfig.finalize_model_grads_func = (
        finalize_alone if alone() and not cfg.model.num_moe_experts else finalize_model_grads
    )
    # fp16 scales the loss; otherwise the scale is a constant 1.0, and multiplying by it is one more op and
    # autograd node a micro-batch for the same gradients (megatron skips the call when there is none).
    tconfig.grad_scale_func = optimizer.scale_loss if precision == "fp16" else None
    if cfg.ddp.overlap_grad_reduce:
        tconfig.no_sync_func = [chunk.no_sync for chunk in model]
        tconfig.no_sync_func = tconfig.no_sync_func[0] if len(model) == 1 else tconfig.no_sync_func
    return optimizer, scheduler
