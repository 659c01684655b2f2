"""Cross-field checks run after every source (recipe, file, overrides) is applied.

Type checks happen as values are set (see typecheck.py); these catch values of the right type
that cannot work together, before any process group starts.
"""

from __future__ import annotations

import dataclasses

from dfm.config.container import HALF_PRECISIONS, ConfigContainer, TrainConfig
from dfm.config.errors import ConfigError
from dfm.config.ranges import check_ranges
from dfm.diffusion.flow import FlowSettings
from dfm.diffusion.timestep_experts import expert_flow_settings
from dfm.parallel.layout import ParallelLayout
from dfm.parallel.rules import check_data_parallel_sharding


def validate_config(cfg: ConfigContainer, world_size: int | None = None) -> None:
    """Raise ConfigError naming the first key whose value cannot work. ``world_size``: the ranks
    launched (None: not known, e.g. a config read outside a run; the rules needing it are skipped)."""
    check_ranges(cfg)
    _check_peft(cfg)
    _check_model(cfg)
    _check_dataset(cfg)
    _check_parallel_layout(cfg, world_size)
    _check_schedule(cfg)
    _check_precision(cfg)
    _check_flow(cfg)
    _check_validation_sizes(cfg)
    _check_distill(cfg)


def _check_peft(cfg: ConfigContainer) -> None:
    if cfg.peft.enabled and not cfg.peft.target_modules:
        raise ConfigError(
            f"peft.target_modules is empty with peft.lora_rank={cfg.peft.lora_rank}: LoRA needs the modules to put "
            "adapters on (e.g. [to_q, to_k, to_v, to_out.0]), or peft.lora_rank=0 for a full fine-tune"
        )


def _check_flow(cfg: ConfigContainer) -> None:
    """The flow settings' own rules (e.g. a field contradicting flow.training_mode), checked as the
    pipeline will build them, before any process starts."""
    try:
        FlowSettings(**expert_flow_settings(cfg.model, dataclasses.asdict(cfg.flow)))
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _check_schedule(cfg: ConfigContainer) -> None:
    """megatron's LR scheduler needs warm-up to end before the decay does."""
    warmup, decay = cfg.scheduler.lr_warmup_iters, cfg.scheduler.decay_iters(cfg.train.train_iters)
    if cfg.train.train_iters >= 1 and warmup >= decay:
        source = "scheduler.lr_decay_iters" if cfg.scheduler.lr_decay_iters is not None else "train.train_iters"
        raise ConfigError(
            f"scheduler.lr_warmup_iters ({warmup}) must be less than {source} ({decay}): the warm-up has to "
            "end before the learning-rate schedule does"
        )


def _check_model(cfg: ConfigContainer) -> None:
    """Rules across model fields (each number's own range is ranges.py's)."""
    model = cfg.model
    if model.hidden_size % model.num_attention_heads:
        raise ConfigError(
            f"model.hidden_size ({model.hidden_size}) must be divisible by "
            f"model.num_attention_heads ({model.num_attention_heads})"
        )
    if model.wan_image_condition and model.architecture != "wan":
        raise ConfigError(f"model.wan_image_condition is Wan's (Wan 2.2 I2V); model.architecture={model.architecture}")
    _check_sizes([model.max_latent_thw], 3, "model.max_latent_thw")
    if model.wan_boundary_ratio is not None and model.wan_expert is None:
        raise ConfigError(
            f"model.wan_boundary_ratio={model.wan_boundary_ratio} is a two-expert model (Wan 2.2 A14B): set "
            "model.wan_expert=high_noise|low_noise|both, the expert this run trains"
        )
    if model.wan_expert == "both":
        _check_both_experts(cfg)


def _check_both_experts(cfg: ConfigContainer) -> None:
    """A run of both Wan 2.2 experts splits each pack between them (dfm/models/wan/experts.py): the
    layouts where ranks of one collective could run different experts, or a pack is cut, are refused."""
    layout = ParallelLayout.from_config(cfg.model, None)
    refused = {
        layout.key("pp"): layout.pp > 1,  # each stage would need both experts' stages and routing
        layout.key("cp"): layout.cp > 1,  # the sub-packs would need their own CP split
        "ddp.use_megatron_fsdp": cfg.ddp.use_megatron_fsdp,  # DP ranks would gather different experts
    }
    if cfg.model.wan_boundary_ratio is None:
        raise ConfigError("model.wan_expert=both needs model.wan_boundary_ratio (the experts' boundary)")
    for key, refuse in refused.items():
        if refuse:
            raise ConfigError(f"model.wan_expert=both (two Wan 2.2 experts in one run) does not support {key} here")


def _check_parallel_layout(cfg: ConfigContainer, world_size: int | None) -> None:
    """The layout's own rules, the model's under it (dfm/parallel/rules.py), and the batch it splits."""
    layout = ParallelLayout.from_config(cfg.model, world_size)
    layout.check_model(cfg.model, cfg.dataset.seq_length)
    check_data_parallel_sharding(cfg.ddp, layout)
    if world_size is not None and cfg.train.global_batch_size is not None:
        micro_batches_per_step(cfg.train, layout)


def micro_batches_per_step(train: TrainConfig, layout: ParallelLayout) -> int:
    """global_batch_size / (micro_batch_size x dp); ConfigError naming the keys when it does not divide."""
    per_step = train.micro_batch_size * layout.dp
    if train.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size ({train.global_batch_size}) must be a multiple of train.micro_batch_size "
            f"({train.micro_batch_size}) x the data-parallel size ({layout.dp} of {layout.world_size} ranks) "
            f"= {per_step}"
        )
    return train.global_batch_size // per_step


def _check_precision(cfg: ConfigContainer) -> None:
    if cfg.model.attention_backend == "varlen" and cfg.mixed_precision.precision not in HALF_PRECISIONS:
        raise ConfigError(
            "model.attention_backend=varlen runs torch's flash kernel, which takes bf16 or fp16, not "
            f"mixed_precision.precision={cfg.mixed_precision.precision}: set model.attention_backend=auto or flex"
        )
    fp8 = cfg.mixed_precision.fp8
    if fp8 is not None and cfg.mixed_precision.precision == "fp16":
        # FP8 products come out in the run's dtype: fp16's range would need a loss scale around them too.
        raise ConfigError(f"mixed_precision.fp8={fp8!r} runs with precision bf16 or fp32, not fp16")
    if fp8 is not None and cfg.model.attention_backend == "te":
        # dfm's FP8 products live in its own linears; TE's modules would need TE's fp8_autocast, not wired.
        raise ConfigError(
            f"mixed_precision.fp8={fp8!r} runs on dfm's linears (model.attention_backend varlen, flex, sdpa "
            "or auto without Transformer Engine), not model.attention_backend=te"
        )


def _check_dataset(cfg: ConfigContainer) -> None:
    data = cfg.dataset
    _check_sizes(data.mock_image_sizes, 2, "dataset.mock_image_sizes")
    _check_sizes(data.mock_video_sizes, 3, "dataset.mock_video_sizes")
    _check_sizes([data.mock_text_len_range], 2, "dataset.mock_text_len_range")
    low, high = data.mock_text_len_range
    if low > high:
        raise ConfigError(f"dataset.mock_text_len_range must be [low, high] with low <= high, got {low} > {high}")
    if high > cfg.model.max_text_len:
        raise ConfigError(
            f"dataset.mock_text_len_range high end ({high}) exceeds model.max_text_len ({cfg.model.max_text_len})"
        )


def _check_sizes(sizes: list[list[int]], length: int, key: str) -> None:
    for size in sizes:
        if len(size) != length or any(n < 1 for n in size):
            raise ConfigError(f"{key} entries must be {length} positive ints, got {size}")


def _check_validation_sizes(cfg: ConfigContainer) -> None:
    """Each ``validation.sizes`` entry is [frames, height, width], all >= 1."""
    for k, size in enumerate(cfg.validation.sizes):
        if len(size) != 3 or min(size) < 1:
            raise ConfigError(f"validation.sizes[{k}]={size}: expected [frames, height, width] in pixels, each >= 1")


def _check_distill(cfg: ConfigContainer) -> None:
    """The DMD2 settings' own rules; with ``distill.enabled``, what the distillation run needs and what it
    does not run yet (docs/distillation.md, "Not built yet"), each refused naming the key to change."""
    try:
        cfg.distill.settings()
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if not cfg.distill.enabled:
        return
    layout = ParallelLayout.from_config(cfg.model, None)
    refused = {
        "model.pipeline": (
            cfg.model.pipeline != "flow",
            "needs model.pipeline=flow (DMD2 is built on the flow pipeline)",
        ),
        "checkpoint.pretrained": (not cfg.checkpoint.pretrained, "needs checkpoint.pretrained=DIR, the teacher"),
        # The student's sample must pass through the whole teacher and critic: not the stage split of a loss.
        layout.key("pp"): (layout.pp > 1, f"does not support {layout.key('pp')} > 1 yet"),
        "model.wan_expert": (cfg.model.wan_expert == "both", "trains one model, not both Wan 2.2 experts"),
        "peft.lora_rank": (cfg.peft.enabled, "trains full models, not LoRA adapters, yet"),
    }
    for key, (refuse, why) in refused.items():
        if refuse:
            raise ConfigError(f"distill.enabled=true {why}: {key}={_value(cfg, key)} is refused")


def _value(cfg: ConfigContainer, key: str):
    section, _, name = key.partition(".")
    return getattr(getattr(cfg, section), name)
