"""The allowed range of every numeric config field, checked before any process starts.

Keys are dotted config keys; a ``*`` pattern covers a family of fields (the parallel sizes).
tests/faults/test_config_ranges.py proves every numeric field of every section has a range here.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from dataclasses import dataclass

from dfm.config.container import ConfigContainer
from dfm.config.errors import ConfigError


@dataclass(frozen=True)
class Range:
    """``low <= value <= high`` (``<`` where open); ``None`` allowed only if ``optional``."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    optional: bool = False
    infinite_ok: bool = False

    def problem(self, value) -> str | None:
        """Why ``value`` is out of range, or None."""
        if value is None:
            return None if self.optional else f"must be {self.describe()}, got None"
        not_finite = isinstance(value, float) and (math.isnan(value) or (math.isinf(value) and not self.infinite_ok))
        too_low = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        too_high = self.high is not None and (value >= self.high if self.high_open else value > self.high)
        if not (not_finite or too_low or too_high):
            return None
        return f"must be {self.describe()}, got {value}" + (" (or null to leave it unset)" if self.optional else "")

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            return f"in {left}{self.low:g}, {self.high:g}{right}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {self.high:g}"
        return "a finite number"


def at_least(low: float, optional: bool = False) -> Range:
    return Range(low=low, optional=optional)


POSITIVE = Range(low=0, low_open=True)
COUNT = at_least(1)
OPTIONAL_COUNT = at_least(1, optional=True)
NON_NEGATIVE = at_least(0)
PROBABILITY = Range(0, 1)
DROPOUT = Range(0, 1, high_open=True)
ANY = Range()

RANGES: dict[str, Range] = {
    "model.num_layers": COUNT,
    "model.hidden_size": COUNT,
    "model.num_attention_heads": COUNT,
    "model.ffn_hidden_size": OPTIONAL_COUNT,
    "model.in_channels": COUNT,
    "model.out_channels": OPTIONAL_COUNT,
    "model.patch_spatial": COUNT,
    "model.patch_temporal": COUNT,
    "model.text_embed_dim": COUNT,
    "model.max_text_len": COUNT,
    "model.layernorm_epsilon": POSITIVE,
    "model.hidden_dropout": DROPOUT,
    "model.attention_dropout": DROPOUT,
    "model.num_classes": OPTIONAL_COUNT,
    "model.*_parallel_size": OPTIONAL_COUNT,  # None only where the field allows it (virtual pipeline)
    "model.num_moe_experts": OPTIONAL_COUNT,
    "model.moe_router_topk": COUNT,
    "model.moe_ffn_hidden_size": OPTIONAL_COUNT,
    "model.moe_aux_loss_coeff": NON_NEGATIVE,
    "model.recompute_num_layers": OPTIONAL_COUNT,
    "model.init_method_std": POSITIVE,
    "model.adaln_lora_dim": OPTIONAL_COUNT,
    "model.cross_attention_dim": OPTIONAL_COUNT,
    "model.num_single_layers": NON_NEGATIVE,
    "model.pooled_text_dim": OPTIONAL_COUNT,
    "model.guidance": NON_NEGATIVE,
    "model.text_embed_2_dim": OPTIONAL_COUNT,
    "model.image_embed_dim": OPTIONAL_COUNT,
    "model.num_refiner_layers": NON_NEGATIVE,
    "model.rope_theta": POSITIVE,
    "model.wan_boundary_ratio": Range(0.0, 1.0, low_open=True, high_open=True, optional=True),
    "train.train_iters": COUNT,
    "train.micro_batch_size": COUNT,
    "train.global_batch_size": OPTIONAL_COUNT,
    "train.eval_interval": OPTIONAL_COUNT,
    "train.eval_iters": COUNT,
    "train.eval_noise_bins": COUNT,
    "train.eval_sampling_steps": COUNT,
    "train.max_consecutive_nonfinite": COUNT,
    "train.collective_timeout_minutes": COUNT,
    "train.stall_timeout_s": at_least(0, optional=True),
    "train.exit_signal_timeout_s": NON_NEGATIVE,
    "train.manual_gc_interval": NON_NEGATIVE,
    "optimizer.lr": NON_NEGATIVE,
    "optimizer.min_lr": NON_NEGATIVE,
    "optimizer.weight_decay": NON_NEGATIVE,
    "optimizer.adam_beta1": DROPOUT,
    "optimizer.adam_beta2": DROPOUT,
    "optimizer.adam_eps": POSITIVE,
    "optimizer.clip_grad": NON_NEGATIVE,  # 0: no clipping
    "optimizer.ema_decay": Range(0, 1, low_open=True, high_open=True, optional=True),
    "scheduler.lr_warmup_iters": NON_NEGATIVE,
    "scheduler.lr_decay_iters": OPTIONAL_COUNT,
    "dataset.seq_length": COUNT,
    "dataset.packing_buffer_size": OPTIONAL_COUNT,
    "dataset.num_workers": NON_NEGATIVE,
    "dataset.shuffle_buffer_size": COUNT,
    "dataset.max_samples_per_sequence": OPTIONAL_COUNT,
    "dataset.cooked_cache_mib": NON_NEGATIVE,
    "dataset.mock_image_fraction": PROBABILITY,
    "dataset.mock_samples_per_pack": OPTIONAL_COUNT,
    "dataset.cfg_dropout_prob": PROBABILITY,
    "dataset.i2v_prob": PROBABILITY,
    "checkpoint.save_interval": OPTIONAL_COUNT,
    "checkpoint.keep_last": OPTIONAL_COUNT,
    "checkpoint.async_save_timeout_s": NON_NEGATIVE,
    "logger.log_interval": COUNT,
    "validation.seed": Range(0, 2**32 - 1),
    "validation.steps": OPTIONAL_COUNT,
    "validation.guidance_scale": NON_NEGATIVE,
    "validation.fps": COUNT,
    "rng.seed": Range(0, 2**32 - 1),  # numpy's seed range
    "edm.P_mean": ANY,
    "edm.P_std": POSITIVE,
    "edm.sigma_data": POSITIVE,
    "edm.sigma_min": POSITIVE,
    "edm.sigma_max": POSITIVE,
    "edm.rho": POSITIVE,
    "edm.S_churn": NON_NEGATIVE,
    "edm.S_min": NON_NEGATIVE,
    "edm.S_max": Range(low=0, infinite_ok=True),
    "edm.S_noise": NON_NEGATIVE,
    "flow.logit_mean": ANY,
    "flow.logit_std": POSITIVE,
    "flow.shift": POSITIVE,
    "flow.uniform_mix": PROBABILITY,
    "flow.sigma_min": DROPOUT,
    "flow.c_noise_scale": POSITIVE,
    "peft.lora_rank": NON_NEGATIVE,
    "peft.lora_alpha": Range(low=0, low_open=True, optional=True),
    "peft.lora_dropout": DROPOUT,
    "flow.t_min": Range(0.0, 1.0),
    "flow.t_max": Range(0.0, 1.0),
    "distill.guidance_scale": NON_NEGATIVE,
    "distill.critic_steps": COUNT,
    "distill.min_t": Range(0.0, 1.0, low_open=True),
    "distill.max_t": Range(0.0, 1.0, low_open=True),
    "distill.regression_weight": NON_NEGATIVE,
    "distill.regression_teacher_steps": COUNT,
    "distill.gan_critic_weight": NON_NEGATIVE,
    "distill.gan_student_weight": NON_NEGATIVE,
    "distill.timestep_shift": POSITIVE,
    "distill.collapse_warning": NON_NEGATIVE,
}


def numeric_fields(node, prefix: str = "") -> dict[str, object]:
    """Every int / float field (optional or not) of ``node``'s dataclass sections, by dotted key -> value."""
    found = {}
    for item in dataclasses.fields(node):
        value, key = getattr(node, item.name), f"{prefix}{item.name}"
        if dataclasses.is_dataclass(value):
            found.update(numeric_fields(value, f"{key}."))
        elif is_numeric(item.type):
            found[key] = value
    return found


def is_numeric(annotation) -> bool:
    """``int``, ``float`` or either ``| None`` (annotations are strings under postponed evaluation)."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    parts = {part.strip() for part in text.split("|")} - {"None"}
    return bool(parts) and parts <= {"int", "float"}


def range_of(key: str) -> Range | None:
    if key in RANGES:
        return RANGES[key]
    return next((r for pattern, r in RANGES.items() if "*" in pattern and fnmatch.fnmatchcase(key, pattern)), None)


def check_ranges(cfg: ConfigContainer) -> None:
    """Raise ConfigError naming the first numeric key out of its range (or without a declared one)."""
    for key, value in numeric_fields(cfg).items():
        allowed = range_of(key)
        if allowed is None:
            raise ConfigError(f"{key} has no allowed range: declare one in dfm/config/ranges.py")
        problem = allowed.problem(value)
        if problem:
            raise ConfigError(f"{key} {problem}")
    check_related(cfg)


def check_related(cfg: ConfigContainer) -> None:
    """Ranges that depend on another field."""
    train, model = cfg.train, cfg.model
    if train.global_batch_size is not None and train.global_batch_size % train.micro_batch_size:
        raise ConfigError(
            f"train.global_batch_size ({train.global_batch_size}) must be a multiple of train.micro_batch_size "
            f"({train.micro_batch_size}) x the data-parallel size"
        )
    if model.num_moe_experts is not None and model.moe_router_topk > model.num_moe_experts:
        raise ConfigError(
            f"model.moe_router_topk ({model.moe_router_topk}) must be <= model.num_moe_experts ({model.num_moe_experts})"
        )
    if cfg.optimizer.min_lr > cfg.optimizer.lr:
        raise ConfigError(f"optimizer.min_lr ({cfg.optimizer.min_lr}) must be <= optimizer.lr ({cfg.optimizer.lr})")
