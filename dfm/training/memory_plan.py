"""The bytes a run will need per rank in each phase (build, training step, save, load), before it starts,
and the start-up log of what the built ranks hold (``log_memory``) beside that plan.

* build: the rank's share of the parameters (its TP / PP slice; under Megatron-FSDP its 1/D shard),
  materialised one chunk of at most ``BUILD_CHUNK`` at a time (the meta-device build).
* training step: parameters + gradients + optimizer state (``dfm.training.memory``), the activations
  saved for backward (a formula per family, below) for the micro-batches in flight, the backward's
  recompute working set, and under FSDP the gathered units (two blocks' bf16 weights in flight, one
  block's unsharded fp32 gradient before its reduce-scatter).
* save / load: the state, plus at most the rank's own shard of the checkpoint (model weights + fp32
  main weights + moments, 1/D of them) staged, plus one bounded buffer (``IO_BUFFER``). Activations
  are gone by then: saves run between steps.

Activations. Each family's block keeps, per layer, ``token_h`` bytes per video token per hidden unit,
``token_ffn`` per video token per FFN unit and ``text_h`` per text token per hidden unit (its cross-
attention keys / values); outside the blocks (embedders, final layer) ``outside_token_h`` and
``outside_text_h``. A fully recomputed layer keeps only its input: ``RECOMPUTE_TOKEN_H`` bytes (one
bf16 vector) per token per hidden unit. The coefficients are the bf16 bytes counted on the CPU with
``torch.autograd.graph.saved_tensors_hooks`` (unique storages, parameters excluded) over tiny models
of every family, SDPA attention (no s^2 term); ``tests/training/test_memory_plan.py`` checks the
formula against that count at two sizes per family within 15%. FLUX's double-stream blocks carry
text and image tokens alike, and its single-stream blocks their concatenation: both count s + m.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass

import torch

from dfm.checkpoint.files import format_bytes
from dfm.training.memory import (
    STATE_LOG_KEY,
    BytesPerParameter,
    RankBytes,
    bytes_per_parameter,
    layout_name,
    local_parameter_count,
    measured_bytes,
    state_formula,
    trainable_parameter_count,
    write_memory_record,
)

BUILD_CHUNK = 256 * 2**20  # the meta-device build's largest materialised chunk
IO_BUFFER = 256 * 2**20  # one bounded staging / read buffer of the sharded save and load
RECOMPUTE_TOKEN_H = 2.0  # a recomputed layer keeps its bf16 input
RECOMPUTE_ACTIVATION_TOKEN_FFN = 2.0  # model.recompute_activation: the activation output (fc2's input) is not kept
logger = logging.getLogger("dfm.train")
DEVICE_RESERVE = 0.10  # CUDA context, NCCL buffers and allocator fragmentation: a fit leaves 10% free


@dataclass(frozen=True)
class Coefficients:
    """Saved-for-backward bf16 bytes, per layer unless named ``outside``."""

    token_h: float
    token_ffn: float
    text_h: float
    outside_token_h: float
    outside_text_h: float
    single_token_h: float = 0.0  # FLUX single-stream blocks (per s + m token)
    single_token_ffn: float = 0.0


# Counted on CPU, bf16, SDPA (see the module docstring); FLUX's text_h is unused (text counts as tokens).
# The DiT family's token_h re-counted after the lean block (per-sample adaLN rows, normed inputs
# recomputed, q/k norm + RoPE fused, attention output kept once): dit_adaln -22, dit_cross -41,
# stdit -40, moviegen -45 bytes per token per hidden unit per layer (hidden 512, 4 x 1024 tokens).
# Wan's re-counted after its lean block (modulation rows, q / k norm across heads keeping its input):
# fitted by least squares to the per-layer count at five (hidden, FFN, text) sizes.
# FLUX re-counted after its lean blocks (the same pieces; hidden 256, FFN 2h and 4h, 2 x 128 image +
# 32 text tokens).
# The final layer (FinalLayer: norm and modulation as the blocks', norm_recompute.py) keeps neither the normed
# tensor nor a per-token scale: ``outside_token_h`` 4 (DiT family, FLUX) to 6 (MovieGen) bytes lower than
# before (2026-11-29), for packs of one length and mixed ones alike.
FAMILY = {
    "dit_adaln": Coefficients(21.1, 3.9, 0.0, 4.5, 0.0),
    "dit_cross": Coefficients(35.5, 3.7, 4.7, 4.4, 4.6),
    "stdit": Coefficients(48.4, 3.7, 4.7, 4.4, 4.6),
    "moviegen": Coefficients(33.0, 6.0, 4.7, 4.4, 4.6),
    "wan": Coefficients(34.3, 4.0, 6.2, 8.4, 4.6),
    "flux": Coefficients(24.4, 4.0, 0.0, 4.5, 3.0, single_token_h=18.3, single_token_ffn=4.0),
}
# HunyuanVideo 1.5's blocks are FLUX's double-stream blocks: FLUX's coefficients (not counted apart).
FAMILY["hunyuan_video15"] = FAMILY["flux"]
JOINT = ("flux", "hunyuan_video15")  # text counts as tokens of the joint sequence


def layer_activation_bytes(model_cfg, tokens: int, text_tokens: int) -> list[float]:
    """Bytes one micro-batch's forward keeps in each block (no recompute), in block order."""
    c, h, f = FAMILY[model_cfg.architecture], model_cfg.hidden_size, model_cfg.effective_ffn_hidden_size
    if model_cfg.recompute_activation:  # the dense MLPs and FLUX's single-stream blocks
        fewer = RECOMPUTE_ACTIVATION_TOKEN_FFN
        c = dataclasses.replace(c, token_ffn=c.token_ffn - fewer, single_token_ffn=c.single_token_ffn - fewer)
    if model_cfg.architecture in JOINT:
        joint = tokens + text_tokens
        double = joint * (c.token_h * h + c.token_ffn * f)
        single = joint * (c.single_token_h * h + c.single_token_ffn * f)
        num_single = model_cfg.num_single_layers
        return [double] * (model_cfg.num_layers - num_single) + [single] * num_single
    per_layer = tokens * (c.token_h * h + c.token_ffn * f) + text_tokens * c.text_h * h
    return [per_layer] * model_cfg.num_layers


def recomputed_layers(model_cfg, num_layers: int) -> int:
    """How many of ``num_layers`` blocks keep only their input (megatron's uniform / block methods)."""
    if model_cfg.recompute_granularity != "full":
        return 0
    if model_cfg.recompute_method == "block":
        return min(num_layers, model_cfg.recompute_num_layers or 1)
    return num_layers


@dataclass(frozen=True)
class Activations:
    saved: float  # kept from the forward until the backward, all micro-batches in flight
    working: float  # the backward's extra: the recomputed chunk's full activations


def activation_bytes(model_cfg, tokens: int, text_tokens: int, in_flight: int = 1, stage_layers=None) -> Activations:
    """Activations of one rank: ``tokens`` video and ``text_tokens`` text tokens per micro-batch on it,
    ``in_flight`` micro-batches held at once (pipeline warm-up), the blocks ``stage_layers`` (a slice;
    default all) on this stage."""
    c = FAMILY[model_cfg.architecture]
    layers = layer_activation_bytes(model_cfg, tokens, text_tokens)[stage_layers or slice(None)]
    h = model_cfg.hidden_size
    joint = tokens + text_tokens if model_cfg.architecture in JOINT else tokens
    n_recomputed = recomputed_layers(model_cfg, len(layers))
    chunk = (model_cfg.recompute_num_layers or 1) if n_recomputed else 0
    # uniform: one kept input per chunk of ``chunk`` blocks; block: each of the first blocks alone.
    inputs = -(-n_recomputed // chunk) if n_recomputed and model_cfg.recompute_method != "block" else n_recomputed
    kept = sum(layers[n_recomputed:]) + inputs * joint * RECOMPUTE_TOKEN_H * h
    outside = tokens * c.outside_token_h * h + text_tokens * c.outside_text_h * h
    # The backward recomputes one checkpointed chunk at a time (block: one block).
    working = max(layers[:chunk], default=0.0) * (1 if model_cfg.recompute_method == "block" else chunk)
    return Activations(saved=in_flight * (kept + outside), working=working)


@dataclass(frozen=True)
class PhasePlan:
    """Bytes per rank of each phase and the pieces of the training step."""

    build: int
    state: RankBytes
    activations: Activations
    fsdp_units: int
    save: int
    load: int
    ema: int = 0  # the EMA weights' copy (optimizer.ema_decay), held through every phase after the build

    @property
    def train(self) -> int:
        return int(self.state.total + self.ema + self.activations.saved + self.activations.working + self.fsdp_units)

    def peak(self) -> int:
        return max(self.build, self.train, self.save, self.load)

    def fits(self, device_bytes: int) -> bool:
        return self.peak() <= device_bytes * (1 - DEVICE_RESERVE)


def parameter_bytes(cfg) -> BytesPerParameter:
    """Bytes per parameter of weights, gradients and optimizer state as ``cfg``'s precision, ``ddp`` and
    ``optimizer`` sections lay them out."""
    ddp = cfg.ddp
    return bytes_per_parameter(
        cfg.mixed_precision.precision, ddp.grad_reduce_in_fp32, cfg.optimizer.optimizer, ddp.use_megatron_fsdp
    )


def own_checkpoint_shard(share: int, per: BytesPerParameter, shards: int, trainable: int | None = None) -> int:
    """The rank's own share of a checkpoint of ``share`` parameters: model weights, plus fp32 main weights and
    moments of the ``trainable`` ones (None: all), 1/``shards`` of them."""
    return (share * per.params + (share if trainable is None else trainable) * per.optimizer) // shards


def rank_plan(
    cfg, layout, share: int, tokens: int, text_tokens: int, in_flight: int = 1, trainable: int | None = None
) -> PhasePlan:
    """The plan of a rank holding ``share`` parameters (its TP / PP slice before data-parallel sharding),
    ``trainable`` of them trained (LoRA: the adapters; None: all)."""
    model_cfg = cfg.model
    name = ddp_layout(cfg)
    shards = layout.dp * layout.cp
    per = parameter_bytes(cfg)
    state = state_formula(share, per, name, shards, trainable)
    stage_layers = model_cfg.num_layers // layout.pp
    activations = activation_bytes(model_cfg, tokens, text_tokens, in_flight, slice(0, stage_layers))
    block = share // max(stage_layers, 1)
    fsdp = 2 * block * per.params + block * per.grads if name == "optim_grads_params" else 0
    ema, ema_shard = ema_bytes(cfg, share, name, shards)
    checkpoint_io = state.total + ema + own_checkpoint_shard(share, per, shards, trainable) + ema_shard + IO_BUFFER
    return PhasePlan(state.params + BUILD_CHUNK, state, activations, fsdp, checkpoint_io, checkpoint_io, ema)


def ddp_layout(cfg) -> str:
    """The ``ddp`` section's state layout, by ``memory.layout_name``'s names."""
    ddp = cfg.ddp
    return layout_name(ddp.use_megatron_fsdp, ddp.data_parallel_sharding_strategy, ddp.use_distributed_optimizer)


def ema_bytes(cfg, share: int, layout: str, shards: int) -> tuple[int, int]:
    """(held, the rank's own share of a checkpoint's) bytes of the fp32 EMA of the rank's parameters when
    ``optimizer.ema_decay`` keeps one (dfm/training/ema.py): of its ``share`` (TP / PP slice), or under
    Megatron-FSDP's full sharding of its rows only; (0, 0) without."""
    if cfg.optimizer.ema_decay is None:
        return 0, 0
    held = 4 * (math.ceil(share / shards) if layout == "optim_grads_params" else share)
    return held, held if layout == "optim_grads_params" else held // shards


def tokens_per_rank(cfg, layout, samples_per_pack: int = 1) -> tuple[int, int]:
    """(video tokens, text tokens) of one micro-batch on one rank: the packing limit split over CP
    (and over TP under sequence parallelism); text at ``max_text_len`` per sample, whole on every rank."""
    split = layout.cp * (layout.tp if cfg.model.sequence_parallel else 1)
    video = cfg.dataset.seq_length * cfg.train.micro_batch_size // split
    return video, samples_per_pack * cfg.train.micro_batch_size * cfg.model.max_text_len


def pipeline_in_flight(layout, microbatches: int) -> int:
    """Micro-batches the first pipeline stage holds at once under 1F1B (1 without pipelining)."""
    return min(layout.pp, microbatches)


def describe(plan: PhasePlan, device_bytes: int | None) -> list[str]:
    """Readable lines: each phase, the training step's pieces, and whether it fits ``device_bytes``."""
    a = plan.activations
    lines = [
        f"build {format_bytes(plan.build)} (the rank's parameters + one init chunk <= {format_bytes(BUILD_CHUNK)})",
        f"training step {format_bytes(plan.train)}: {plan.state.describe()}"
        + (f", EMA {format_bytes(plan.ema)}" if plan.ema else "")
        + "; activations saved "
        f"{format_bytes(int(a.saved))}, backward working set {format_bytes(int(a.working))}, "
        f"FSDP gathered units {format_bytes(plan.fsdp_units)}",
        f"save {format_bytes(plan.save)}, load {format_bytes(plan.load)} (state + the rank's own checkpoint "
        f"shard + one {format_bytes(IO_BUFFER)} buffer)",
    ]
    if device_bytes:
        verdict = "fits" if plan.fits(device_bytes) else "DOES NOT FIT"
        lines.append(
            f"peak {format_bytes(plan.peak())} {verdict} {format_bytes(device_bytes)} per device "
            f"(keeping {DEVICE_RESERVE:.0%} free)"
        )
    return lines


def config_plan(cfg, layout, share: int, samples_per_pack: int = 1, trainable: int | None = None) -> PhasePlan:
    """The plan of the first pipeline stage's ranks (they hold the most micro-batches in flight)."""
    from dfm.config.validate import micro_batches_per_step

    tokens, text_tokens = tokens_per_rank(cfg, layout, samples_per_pack)
    in_flight = pipeline_in_flight(layout, micro_batches_per_step(cfg.train, layout))
    return rank_plan(cfg, layout, share, tokens, text_tokens, in_flight, trainable)


def device_memory(device: torch.device) -> int | None:
    """Total memory of a CUDA device; None where it is not known (the CPU)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory


def log_plan(cfg, layout, share: int, device: torch.device, trainable: int | None = None) -> None:
    """Start-up log: the plan's phases for this rank's share (``trainable`` of it trained); a warning
    before the first step when the device memory is known and the plan does not fit it."""
    plan = config_plan(cfg, layout, share, trainable=trainable)
    total = device_memory(device)
    report_plan("memory plan per rank (first pipeline stage)", describe(plan, total), plan, total)


def report_plan(title: str, lines: list[str], plan: PhasePlan, total: int | None) -> None:
    """Log a plan's ``lines`` under ``title``; warn when the device's ``total`` bytes are known and its peak
    does not fit them."""
    logger.info("%s:\n  %s", title, "\n  ".join(lines))
    if total is not None and not plan.fits(total):
        logger.warning(
            "the memory plan's peak %s does not fit this device's %s: expect out-of-memory; shard more "
            "(ddp.data_parallel_sharding_strategy=optim_grads_params, more DP / TP / CP) or recompute "
            "(model.recompute_granularity=full)",
            format_bytes(plan.peak()),
            format_bytes(total),
        )


def log_memory(cfg, layout, model, optimizer) -> None:
    """Start-up log (rank 0): every rank's measured bytes, the formula for rank 0's share (the same
    figures, unrounded, in ``<log_dir>/memory_per_rank.json``), then the plan (``log_plan``)."""
    name = ddp_layout(cfg)
    measured = measured_bytes(model, optimizer, cfg.optimizer.optimizer)
    counts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(
        counts, (measured, local_parameter_count(model), trainable_parameter_count(model))
    )
    if torch.distributed.get_rank() != 0:
        return
    per = parameter_bytes(cfg)
    lines = [f"rank {rank}: {held.describe()}" for rank, (held, *_) in enumerate(counts)]
    formula = state_formula(counts[0][1], per, name, layout.dp * layout.cp, counts[0][2])
    write_memory_record(cfg.logger.log_dir, name, layout.dp * layout.cp, counts, per)
    logger.info(
        "memory per rank (%s, %d parameters on rank 0, sharded over %d DP x CP ranks):\n  %s\n  formula, rank 0: %s",
        name,
        counts[0][1],
        layout.dp * layout.cp,
        "\n  ".join(lines),
        formula.describe(),
    )
    # One machine-readable line (benchmarks.memory_phases reads it).
    logger.info("%s %s", STATE_LOG_KEY, json.dumps([held.total for held, *_ in counts]))
    log_plan(cfg, layout, counts[0][1], next(model[0].parameters()).device, trainable=counts[0][2])
