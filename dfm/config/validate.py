"""Cross-field checks run after every source (recipe, file, overrides) is applied.

Type checks happen as values are set (see typecheck.py); these catch values of the right type
that cannot work together, before any process group starts.
"""

from __future__ import annotations

from dfm.config.container import ConfigContainer
from dfm.config.errors import ConfigError
from dfm.config.ranges import check_ranges


def validate_config(cfg: ConfigContainer) -> None:
    """Raise ConfigError naming the first key whose value cannot work."""
    check_ranges(cfg)
    _check_model(cfg)
    _check_dataset(cfg)
    _check_context_parallel(cfg)
    _check_positive(cfg.train.micro_batch_size, "train.micro_batch_size")
    _check_at_least(cfg.train.train_iters, 0, "train.train_iters")
    _check_positive(cfg.logger.log_interval, "logger.log_interval")
    _check_precision(cfg)


def _check_model(cfg: ConfigContainer) -> None:
    model = cfg.model
    for name in (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "in_channels",
        "patch_spatial",
        "patch_temporal",
        "text_embed_dim",
        "max_text_len",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "context_parallel_size",
        "expert_model_parallel_size",
    ):
        _check_positive(getattr(model, name), f"model.{name}")
    if model.hidden_size % model.num_attention_heads:
        raise ConfigError(
            f"model.hidden_size ({model.hidden_size}) must be divisible by "
            f"model.num_attention_heads ({model.num_attention_heads})"
        )
    _check_sizes([model.max_latent_thw], 3, "model.max_latent_thw")
    _check_pipeline_stages(model)


def _check_pipeline_stages(model) -> None:
    """Every (virtual) pipeline stage needs the same whole number of layers."""
    virtual = model.virtual_pipeline_model_parallel_size or 1
    stages = model.pipeline_model_parallel_size * virtual
    if model.num_layers % stages:
        raise ConfigError(
            f"model.num_layers ({model.num_layers}) must be a multiple of the pipeline stages: "
            f"pipeline_model_parallel_size ({model.pipeline_model_parallel_size}) x "
            f"virtual_pipeline_model_parallel_size ({virtual}) = {stages}"
        )


def _check_precision(cfg: ConfigContainer) -> None:
    if cfg.mixed_precision.fp8 is not None:
        # Refused rather than ignored: fp8 needs TE's fp8_autocast around the DiT layers, which
        # is not wired (no GPU with Transformer Engine to prove it on).
        raise ConfigError(
            f"mixed_precision.fp8={cfg.mixed_precision.fp8!r} is not supported yet; use mixed_precision.precision=bf16"
        )


def _check_dataset(cfg: ConfigContainer) -> None:
    data = cfg.dataset
    _check_positive(data.seq_length, "dataset.seq_length")
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


def _check_context_parallel(cfg: ConfigContainer) -> None:
    """Each sample is cut into 2*cp chunks (load balance), each CP share split over TP under SP;
    ST-DiT's all-to-all gives every CP rank heads/(tp*cp) whole heads."""
    model, cp = cfg.model, cfg.model.context_parallel_size
    if cp == 1:
        return
    tp = model.tensor_model_parallel_size
    multiple = 2 * cp * (tp if model.sequence_parallel else 1)
    split = f"2 x context_parallel_size ({cp})" + (
        f" x tensor_model_parallel_size ({tp})" if multiple != 2 * cp else ""
    )
    length = cfg.dataset.seq_length
    problem = "is too short to split" if length < multiple else "is not divisible" if length % multiple else None
    if problem:
        raise ConfigError(
            f"dataset.seq_length ({length}) {problem}: context parallelism pads every sample to a multiple of "
            f"{split} = {multiple} tokens and needs seq_length a multiple of it"
        )
    if model.architecture == "stdit" and model.num_attention_heads % (tp * cp):
        raise ConfigError(
            f"model.num_attention_heads ({model.num_attention_heads}) must be divisible by tensor_model_parallel_size "
            f"({tp}) x context_parallel_size ({cp}): stdit re-shards attention heads over the context-parallel ranks"
        )


def _check_sizes(sizes: list[list[int]], length: int, key: str) -> None:
    for size in sizes:
        if len(size) != length or any(n < 1 for n in size):
            raise ConfigError(f"{key} entries must be {length} positive ints, got {size}")


def _check_positive(value: int, key: str) -> None:
    _check_at_least(value, 1, key)


def _check_at_least(value: int, low: int, key: str) -> None:
    if value < low:
        raise ConfigError(f"{key} must be >= {low}, got {value}")
