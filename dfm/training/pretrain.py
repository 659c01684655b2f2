"""The training loop: megatron-core schedule, DDP, optimizer; checkpoints, faults and metrics."""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.pipeline_parallel import get_forward_backward_func

from dfm.checkpoint.async_wait import finish_async_saves
from dfm.checkpoint.files import set_aside_partial_saves
from dfm.checkpoint.load import load_checkpoint
from dfm.checkpoint.pretrained_model import take_pretrained_model
from dfm.checkpoint.root_lock import root_locked
from dfm.checkpoint.save import save_checkpoint, warn_if_little_room
from dfm.checkpoint.state import TrainingState
from dfm.checkpoint.weights_only import load_pretrained
from dfm.config.container import ConfigContainer
from dfm.config.loader import config_to_dict, format_config, save_config_yaml
from dfm.config.validate import validate_config
from dfm.diffusion.registry import pipeline_from_config
from dfm.diffusion.timestep_experts import BOTH
from dfm.models.flops import training_flops
from dfm.parallel.layout import ParallelLayout, launched_world_size
from dfm.platform.child_stacks import children_write_stacks_on_request, crash_writes_stacks
from dfm.platform.distributed import destroy_distributed, initialize_distributed
from dfm.platform.fork_safety import forked_children_single_threaded
from dfm.platform.frozen_heap import setup_objects_frozen
from dfm.platform.parent_watch import checkpoint_writer_queue_dies_with_us, die_with_launcher
from dfm.platform.process_exit import skip_final_gc_at_exit
from dfm.platform.watchdog import StallWatchdog, stall_timeout
from dfm.training.buffer_grads import arm
from dfm.training.data import build_train_loader, build_val_iterator
from dfm.training.distill_loop import build_distillation
from dfm.training.distill_memory_plan import log_distill_plan
from dfm.training.ema import build_ema
from dfm.training.faults import NonFiniteGuard, PreemptionSignal, step_checks
from dfm.training.forward_step import DiffusionForwardStep
from dfm.training.full_weights import finish_param_gather
from dfm.training.lean_optimizer_step import optimizer_step
from dfm.training.losses import reduce_expert_losses, reduce_loss_and_tokens
from dfm.training.memory_plan import log_memory
from dfm.training.metrics_log import MetricsLog, finite_or_none
from dfm.training.sample_metrics import check_metrics, measure
from dfm.training.setup import build_model, build_optimizer, num_microbatches, schedule_model_and_data
from dfm.training.staged_model import sampling_model
from dfm.training.throughput import device_peak_flops, mfu
from dfm.training.validation import (
    first_sample_text,
    generate_validation_sample,
    level_record,
    losses_per_level,
)

logger = logging.getLogger("dfm.train")


class RecordingIterator:
    """Wraps the loader to remember the per-sample lengths of each pack (for FLOPs / tokens)."""

    def __init__(self, loader):
        self.loader = loader
        self.packs: list[tuple[list[int], list[int], list[int]]] = []  # video lens, text lens, latent frames

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.loader)
        self.packs.append(
            (
                batch.host_sample_lengths(),
                batch.host_text_lengths(),
                batch.latent_shape[:, 1].tolist(),
            )
        )
        return batch

    def take(self) -> list[tuple[list[int], list[int], list[int]]]:
        packs, self.packs = self.packs, []
        return packs

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, state) -> None:
        self.loader.load_state_dict(state)


@dataclass
class LogWindow:
    """Work done since the last log line."""

    start: float = field(default_factory=time.perf_counter)
    iterations: int = 0
    packs: list = field(default_factory=list)


def finalize_defaults(cfg: ConfigContainer, layout: ParallelLayout) -> None:
    """Fill settings that depend on the layout."""
    if cfg.train.global_batch_size is None:
        cfg.train.global_batch_size = cfg.train.micro_batch_size * layout.dp


def train_step(
    forward_step, state: TrainingState, n_micro: int, device, preemption: PreemptionSignal | None = None
) -> tuple:
    """One optimizer step over ``n_micro`` packs of ``state.loader``; a non-finite loss or gradient skips the update.

    -> (losses, updated, grad_norm, preempt): ``preempt`` is True on every rank once any rank got a
    preemption signal (agreed in the same all-reduce as the finite check).
    """
    model, optimizer = state.model, state.optimizer
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    for chunk in model:  # gradients straight into the zeroed buffers (buffer_grads.py)
        arm(getattr(chunk, "buffer_grad_params", ()))
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        **schedule_model_and_data(model, state.loader),
        num_microbatches=n_micro,
        seq_length=1,  # unused: variable_seq_lengths makes stages exchange shapes
        micro_batch_size=1,
        forward_only=False,
    )
    preemption = preemption or PreemptionSignal(enabled=False)
    finite, preempt = step_checks(model, [item["loss_and_tokens"][0] for item in losses], preemption, device)
    if not finite:
        return losses, False, None, preempt
    update_ok, grad_norm, _ = optimizer_step(optimizer)
    if update_ok:
        state.scheduler.step(increment=1)
    return losses, update_ok, grad_norm, preempt


def pretrain(cfg: ConfigContainer, mock: bool, explicit_keys: frozenset[str] | None = None) -> None:
    """Train as ``cfg`` says (``mock``: generated data). ``explicit_keys``: the dotted keys the user set
    (dfm.config.cli); given, ``checkpoint.pretrained`` supplies the other model keys (dfm/checkpoint/pretrained_model.py)."""
    skip_final_gc_at_exit()
    die_with_launcher()
    forked_children_single_threaded()  # async saves fork the rank: no OpenMP pool in the child (fork_safety.py)
    children_write_stacks_on_request()  # a stall's dump shows a stuck checkpoint writer's stacks too
    crash_writes_stacks()  # a rank killed by a fatal signal names where it was
    if cfg.checkpoint.save:
        checkpoint_writer_queue_dies_with_us()
    # From the start: a stop signal during start-up (or one a launcher left ignored) still saves after step one.
    preemption = PreemptionSignal(cfg.train.exit_signal_handler, cfg.train.exit_signal_timeout_s)
    layout = ParallelLayout.from_config(cfg.model, launched_world_size())
    device = initialize_distributed(layout, seed=cfg.rng.seed, timeout_minutes=cfg.train.collective_timeout_minutes)
    try:
        with root_locked(cfg.checkpoint.save):  # one run per checkpoint root, taken before anything is written
            if cfg.checkpoint.pretrained and explicit_keys is not None:
                take_pretrained_model(cfg, explicit_keys)
                validate_config(cfg, layout.world_size)
            run(RunContext(cfg, layout, device, mock), preemption)
    except Exception:
        logger.exception("rank %d failed", torch.distributed.get_rank())
        raise
    finally:
        preemption.restore()
        destroy_distributed()


def announce_config(cfg: ConfigContainer) -> None:
    logger.info("resolved config:\n%s", format_config(cfg))
    for folder in {cfg.logger.log_dir, cfg.checkpoint.save}:
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            save_config_yaml(cfg, Path(folder) / "config.yaml")
    if cfg.checkpoint.save:
        set_aside_partial_saves(cfg.checkpoint.save)


def run(context: RunContext, preemption: PreemptionSignal) -> None:
    cfg, layout, device = context.cfg, context.layout, context.device
    rank = torch.distributed.get_rank()
    finalize_defaults(cfg, layout)
    if rank == 0:
        announce_config(cfg)
    torch.distributed.barrier()  # unfinished saves are set aside before any rank looks for checkpoints
    if cfg.distill.enabled:  # the student, the critic beside it and the frozen teacher (dfm/training/distill_loop.py)
        state, players = build_distillation(
            cfg, layout, device, RecordingIterator(build_train_loader(cfg, layout, context.mock))
        )
        log_distill_plan(cfg, layout, state.model, device)
        TrainLoop(context, state, players.forward_step, preemption, players).run(resume_or_start(cfg, state))
        return
    model, tconfig = build_model(cfg, layout, device)
    optimizer, scheduler = build_optimizer(cfg, model, tconfig)
    log_memory(cfg, layout, model, optimizer)
    data_iter = RecordingIterator(build_train_loader(cfg, layout, context.mock))
    state = TrainingState(model, optimizer, scheduler, data_iter, build_ema(model, cfg.optimizer.ema_decay))
    start = resume_or_start(cfg, state)
    forward_step = DiffusionForwardStep(
        pipeline_from_config(cfg),
        cfg.rng.seed,
        cfg.dataset.cfg_dropout_prob,
        device,
        cfg.dataset.i2v_prob,
        both_experts_boundary(cfg),
    )
    TrainLoop(context, state, forward_step, preemption).run(start)


def resume_or_start(cfg: ConfigContainer, state: TrainingState) -> int:
    """The iteration to start after: ``checkpoint.load``'s, or 0 with the weights of ``checkpoint.pretrained``
    (in the model and every companion) when set."""
    start = load_checkpoint(cfg.checkpoint.load, state, cfg.model, cfg) if cfg.checkpoint.load else 0
    if start == 0 and cfg.checkpoint.pretrained:
        start_from_pretrained(cfg, state.model, state.optimizer, state.ema)
        for companion in state.companions.values():
            start_from_pretrained(cfg, companion.model, companion.optimizer, None)
    warn_if_little_room(cfg.checkpoint.save, state.model, state.ema)
    return start


def both_experts_boundary(cfg: ConfigContainer) -> float | None:
    """Wan 2.2's boundary_ratio when the run trains both experts (model.wan_expert=both), else None."""
    return cfg.model.wan_boundary_ratio if cfg.model.wan_expert == BOTH else None


def start_from_pretrained(cfg: ConfigContainer, model, optimizer, ema) -> None:
    """Initial weights from ``checkpoint.pretrained``; the optimizer's main copies and EMA follow them."""
    load_pretrained(cfg.checkpoint.pretrained, model, cfg.model)
    optimizer.reload_model_params()
    if ema is not None:
        ema.reset(model)


@dataclass(frozen=True)
class RunContext:
    """The settings every part of a run reads: resolved config, parallel layout, compute device, mock data."""

    cfg: ConfigContainer
    layout: ParallelLayout
    device: torch.device
    mock: bool


class TrainLoop:
    """Steps, logging, validation and checkpoints of one run (``state.loader`` is a RecordingIterator)."""

    def __init__(self, context: RunContext, state: TrainingState, forward_step, preemption=None, players=None):
        self.context, self.state, self.forward_step = context, state, forward_step
        # A distillation's step and metrics line (dfm/training/distill_loop.py); None: this model's own.
        self.players = players
        cfg, layout, device = context.cfg, context.layout, context.device
        self.cfg, self.layout, self.device = cfg, layout, device
        self.async_saves = AsyncCallsQueue() if cfg.checkpoint.async_save else None
        self.saving: Path | None = None  # the folder the async save in flight writes
        # Validation: no text dropout, noise fixed (iteration 0) so evaluations are comparable.
        self.val_forward_step = DiffusionForwardStep(
            forward_step.pipeline, cfg.rng.seed, 0.0, device, expert_boundary=forward_step.expert_boundary
        )
        self.n_micro = num_microbatches(cfg, layout)
        self.peak = device_peak_flops(device)
        self.metrics = MetricsLog(
            cfg.logger.log_dir,
            enabled=torch.distributed.get_rank() == 0,
            tensorboard_dir=cfg.logger.tensorboard_dir,
            wandb_project=cfg.logger.wandb_project,
            wandb_name=cfg.logger.wandb_exp_name,
            run_config=config_to_dict(cfg),
        )
        self.guard = NonFiniteGuard(cfg.train.max_consecutive_nonfinite)
        self.signal = preemption or PreemptionSignal(enabled=False)
        self.watchdog = StallWatchdog(None)  # run() starts the real one (train.stall_timeout_s)
        self.validation_encoders = None  # validation.prompts' text encoder and VAE, loaded when first needed
        check_metrics(cfg.validation.metrics)  # an unknown name fails now, not at the first evaluation

    def run(self, start: int) -> None:
        cfg, window = self.cfg, LogWindow()
        timeout = stall_timeout(cfg.train.stall_timeout_s, self.device.type == "cuda")
        self.watchdog = StallWatchdog(timeout, torch.distributed.get_rank())
        try:
            with setup_objects_frozen():  # the run's built objects skipped by the collector (frozen_heap.py)
                for iteration in range(start + 1, cfg.train.train_iters + 1):
                    self.watchdog.beat(f"iteration {iteration}")
                    outcome, preempt = self.step(iteration)
                    if self.async_saves is not None:
                        self.async_saves.maybe_finalize_async_calls(blocking=False)
                    window.iterations += 1
                    window.packs += self.state.loader.take()
                    last = iteration == cfg.train.train_iters
                    if iteration % cfg.logger.log_interval == 0 or last:
                        self.log(iteration, outcome, window)
                        window = LogWindow()
                    if preempt:
                        self.save_and_stop(iteration)
                        return
                    if cfg.train.eval_interval and (iteration % cfg.train.eval_interval == 0 or last):
                        self.watchdog.beat(f"validation at iteration {iteration}")
                        self.validate(iteration)
                    interval = cfg.checkpoint.save_interval
                    if last or (interval and iteration % interval == 0):
                        self.save(iteration)
        finally:
            if self.async_saves is not None:
                self.watchdog.beat("the last async save")
                self.finish_async_save()  # the last save sealed and marked `latest` (or abandoned)
            self.watchdog.stop()
            self.metrics.close()

    def step(self, iteration: int) -> tuple[tuple, bool]:
        """One iteration's training -> (what ``log`` reads, preempt)."""
        if self.players is not None:
            return self.players.step(self, iteration)
        losses, updated, grad_norm, preempt = self.train_model(self.forward_step, self.state, iteration)
        self.guard.record(updated, iteration)
        if updated and self.state.ema is not None:
            self.update_ema()
        return (losses, grad_norm), preempt

    def train_model(self, forward_step, state: TrainingState, iteration: int) -> tuple:
        """``train_step`` of ``state``'s model at ``iteration`` (its chunks in training mode)."""
        forward_step.iteration = iteration
        for chunk in state.model:
            chunk.train()
        return train_step(forward_step, state, self.n_micro, self.device, self.signal)

    def save_and_stop(self, iteration: int) -> None:
        """After a preemption signal on any rank: save this step (an in-flight async save completes first)."""
        logger.info("preemption signal received: saving at iteration %d and exiting", iteration)
        self.save(iteration)
        if self.async_saves is not None:
            self.finish_async_save()
        where = (
            f"checkpoint {self.cfg.checkpoint.save}/iter_{iteration:07d}"
            if self.cfg.checkpoint.save
            else "no checkpoint.save"
        )
        logger.info("rank %d exiting after the preemption signal: %s", torch.distributed.get_rank(), where)

    @property
    def model(self) -> list:
        return self.state.model

    def update_ema(self) -> None:
        finish_param_gather(self.model)  # the EMA must see this step's weights on every DP rank
        self.state.ema.update(self.model)

    def generation_weights(self):
        """Sample from the EMA weights when the run keeps them (as DiT does) and validation.use_ema."""
        ema = self.state.ema
        use = ema is not None and self.cfg.validation.use_ema
        return ema.swapped_in(self.model) if use else contextlib.nullcontext()

    def validate(self, iteration: int) -> None:
        train = self.cfg.train
        packs = list(itertools.islice(build_val_iterator(self.cfg, self.layout, self.context.mock), train.eval_iters))
        levels = self.forward_step.pipeline.validation_levels(train.eval_noise_bins)
        means = losses_per_level(self.val_forward_step, packs, self.model, levels, self.device)
        with self.generation_weights():
            multiples = self.layout.padding_multiples()
            path = generate_validation_sample(
                self.cfg, self.model, self.forward_step.pipeline, packs[0], iteration, self.device, multiples
            )
            samples = self.decoded_samples(iteration, first_sample_text(packs[0])[1])
        record = {"iteration": iteration, **level_record(levels, means), "generation": str(path) if path else None}
        if self.players is not None:  # a distillation: the critic's losses too
            record |= self.players.validation_losses(self, packs, levels)
        if samples:
            record |= {"samples": [str(s.path) for s in samples], **measure(self.cfg.validation.metrics, samples)}
        self.metrics.write_validation(record)
        self.metrics.media(iteration, samples)

    def decoded_samples(self, iteration: int, default_shape: tuple[int, ...]) -> list:
        """``validation.prompts`` generated (by every rank, at any layout) and decoded (the logging rank
        writes them); [] without prompts."""
        if not self.cfg.validation.prompts:
            return []
        # Imported here: the encoders bring transformers and diffusers, ~4 CPU s in every rank process
        # of a run that never generates.
        from dfm.training.validation_media import generate_samples, validation_encoders, write_samples

        if self.validation_encoders is None:  # loaded at the first evaluation, kept for the next
            self.validation_encoders = validation_encoders(self.cfg, self.device)
        model, pipeline, encoders = sampling_model(self.model), self.forward_step.pipeline, self.validation_encoders
        multiples = self.layout.padding_multiples()
        samples = generate_samples(self.cfg, model, pipeline, encoders, self.device, default_shape, multiples)
        if not self.metrics.enabled:
            return []
        return write_samples(samples, self.cfg.logger.log_dir, iteration, self.cfg.validation.fps)

    def save(self, iteration: int) -> None:
        if not self.cfg.checkpoint.save:
            return
        self.watchdog.beat(f"the save of iteration {iteration}")
        if self.async_saves is not None:
            self.finish_async_save()  # one save in flight at a time
        checkpoint = self.cfg.checkpoint
        self.saving = save_checkpoint(
            checkpoint.save, iteration, self.state, config_to_dict(self.cfg), checkpoint.keep_last, self.async_saves
        )

    def finish_async_save(self) -> None:
        """Wait for the async save in flight, if any: sealed, or abandoned when its writer stalls
        (dfm/checkpoint/async_wait.py); each byte it writes counts as progress for the stall watchdog."""
        what = self.watchdog.what
        finish_async_saves(
            self.async_saves,
            self.saving,
            self.cfg.checkpoint.async_save_timeout_s,
            on_progress=lambda: self.watchdog.beat(what),
        )

    def log(self, iteration: int, outcome: tuple, window: LogWindow) -> None:
        if self.players is not None:
            record = self.players.record(self, iteration, outcome, window)
            self.metrics.write(record, self.players.console_line(record))
            if self.metrics.enabled:
                self.players.warn_if_collapsing(record)
            return
        losses, grad_norm = outcome
        loss, _ = reduce_loss_and_tokens(losses, self.device)
        experts = reduce_expert_losses(losses, self.device) if self.forward_step.expert_boundary is not None else {}
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - window.start
        self.metrics.write(self.record(iteration, loss, grad_norm, elapsed, window) | experts)

    def record(self, iteration: int, loss: float, grad_norm, elapsed: float, window: LogWindow) -> dict:
        """One metrics.jsonl line. Packs were seen by this rank; scaled to the work per GPU."""
        dp, world = self.layout.dp, self.layout.world_size
        video_lens = [n for q, _, _ in window.packs for n in q]
        text_lens = [n for _, kv, _ in window.packs for n in kv]
        frames = [t // self.cfg.model.patch_temporal for _, _, ts in window.packs for t in ts]
        # Every model-parallel rank of a replica sees the same packs; the replica's work is split over them.
        tokens_per_gpu = sum(video_lens) * dp / world
        tflops = training_flops(self.cfg.model, video_lens, text_lens, frames) * dp / world / elapsed / 1e12
        return {
            "iteration": iteration,
            "train_iters": self.cfg.train.train_iters,
            "loss": loss,
            "lr": self.state.optimizer.param_groups[0]["lr"],
            "grad_norm": finite_or_none(grad_norm),
            "skipped_iterations": self.guard.skipped,
            "step_time_s": elapsed / window.iterations,
            "tokens_per_sec_per_gpu": tokens_per_gpu / elapsed,
            "tflops_per_gpu": tflops,
            "mfu": mfu(tflops, self.peak),
            "global_batch_size": self.cfg.train.global_batch_size,
            # This rank's loader (energon with dataset.skip_bad_samples); each is also logged by name.
            "skipped_bad_samples": getattr(self.state.loader.loader, "skipped_bad_samples", 0),
        }
