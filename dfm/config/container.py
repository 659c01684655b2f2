"""Typed config sections and the `ConfigContainer` that holds one of each.

Adding a section is two steps: define its dataclass here and add one field to `ConfigContainer`.
Every field needs a default so a recipe only states what differs from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dfm.config.distill import DistillConfig
from dfm.config.peft import PeftConfig
from dfm.diffusion.edm import EDMSettings
from dfm.diffusion.flow import FlowSettings

Architecture = Literal["dit_cross", "dit_adaln", "stdit", "moviegen", "flux", "wan", "hunyuan_video15"]
PosEmbedding = Literal["rope3d", "sincos3d", "learned3d"]
AttentionBackend = Literal["auto", "varlen", "flex", "sdpa", "te"]
DiffusionPipeline = Literal["edm", "flow"]
RecomputeGranularity = Literal["full", "selective"]
RecomputeMethod = Literal["uniform", "block"]
LrDecayStyle = Literal["constant", "cosine", "linear"]
Precision = Literal["fp32", "bf16", "fp16"]
HALF_PRECISIONS = ("bf16", "fp16")  # what torch's flash kernels (attention_backend=varlen) take
Fp8Format = Literal["e4m3", "hybrid"]
PackingBalance = Literal["cost", "tokens"]
ShardingStrategy = Literal["no_shard", "optim", "optim_grads", "optim_grads_params"]


@dataclass
class ModelConfig:
    """Architecture, embedding and model-parallel layout of the diffusion transformer."""

    architecture: Architecture = "dit_cross"
    num_layers: int = 12
    hidden_size: int = 384
    num_attention_heads: int = 6
    ffn_hidden_size: int | None = None  # None: 4 * hidden_size
    in_channels: int = 16
    out_channels: int | None = None  # None: in_channels; 2x for DiT's learned-sigma head
    # Wan 2.2 I2V-A14B (dfm/data/video_condition.py): after each patch's in_channels latent channels the patch
    # embedding reads 4 mask + in_channels image-condition channels (diffusers' in_channels 2C + 4 = 36),
    # given per token by the pack (PackedBatch.image_condition).
    wan_image_condition: bool = False
    patch_spatial: int = 2
    patch_temporal: int = 1
    text_embed_dim: int = 4096
    max_text_len: int = 512
    qk_layernorm: bool = False
    layernorm_epsilon: float = 1e-6
    # DiT families (dit_adaln | dit_cross | stdit | moviegen): the blocks' affine-free norm (None: LayerNorm,
    # RMSNorm for moviegen), biases on the transformer linears (moviegen never has them), a low-rank adaLN
    # (h -> rank -> chunks x h, as Cosmos / NeMo's DiT-7B: None is the full h -> chunks x h projection) and
    # the width of the text context the cross-attention's keys / values are projected from (None: hidden_size).
    normalization: Literal["layernorm", "rmsnorm"] | None = None
    add_bias_linear: bool = True
    adaln_lora_dim: int | None = None
    cross_attention_dim: int | None = None
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    pos_embedding: PosEmbedding = "rope3d"
    # [T, H, W] in latent units; sizes the learned / sincos position tables.
    max_latent_thw: list[int] = field(default_factory=lambda: [32, 128, 128])
    attention_backend: AttentionBackend = "auto"
    pipeline: DiffusionPipeline = "edm"
    num_classes: int | None = None  # class-conditioned dit_adaln only
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    expert_model_parallel_size: int = 1
    num_moe_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_aux_loss_coeff: float = 1e-3  # load-balancing loss weight (padding tokens are left out)
    recompute_granularity: RecomputeGranularity | None = None
    recompute_method: RecomputeMethod | None = "uniform"
    recompute_num_layers: int | None = None
    # Dense MLPs: the activation's output (fc2's input) recomputed from fc1's output in backward, not kept
    # (f values per token per layer less, one elementwise pass more; dfm/models/common/activation_mlp.py).
    recompute_activation: bool = False
    init_method_std: float = 0.02
    # torch.compile the blocks' elementwise regions (norm + modulate, gated residual, MLP activation);
    # dynamic shapes, so packs of changing length reuse one graph (dfm/models/common/fused.py).
    compile: bool = False
    # FLUX (architecture=flux): the last num_single_layers of num_layers blocks are single-stream;
    # a pooled text vector per sample; the guidance embedder (FLUX.1-dev) and the guidance value
    # it sees in training; per-axis (t, h, w) RoPE dims, summing to the head dim.
    num_single_layers: int = 0
    pooled_text_dim: int | None = None
    guidance_embeds: bool = False
    guidance: float = 1.0
    rope_axes_dim: list[int] = field(default_factory=lambda: [16, 56, 56])
    # HunyuanVideo 1.5 (architecture=hunyuan_video15): ByT5 glyph text and SigLIP image-embedding widths
    # (the Qwen2.5-VL text is text_embed_dim), the text token refiner's depth and the RoPE base.
    text_embed_2_dim: int | None = None
    image_embed_dim: int | None = None
    num_refiner_layers: int = 2
    rope_theta: float = 10000.0
    # Wan 2.2 A14B (dfm/diffusion/timestep_experts.py): two models split the timesteps at
    # wan_boundary_ratio (the high-noise one takes t >= it); a run trains the expert wan_expert names,
    # its training t drawn on its side of the boundary only, or both (each sample by its t's expert).
    wan_expert: Literal["high_noise", "low_noise", "both"] | None = None
    wan_boundary_ratio: float | None = None

    @property
    def context_width(self) -> int:
        """Width of the text context the cross-attention reads (``cross_attention_dim`` or the hidden size)."""
        return self.cross_attention_dim or self.hidden_size

    @property
    def effective_ffn_hidden_size(self) -> int:
        """`ffn_hidden_size`, or the usual 4x hidden when unset."""
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size


@dataclass
class TrainConfig:
    """Loop length, batch sizes and the loop's safety nets."""

    train_iters: int = 20
    micro_batch_size: int = 1
    global_batch_size: int | None = None  # None: the trainer sets micro_batch_size * dp
    eval_interval: int | None = None
    eval_iters: int = 2  # validation packs per evaluation (per DP rank)
    # Validation loss at this many fixed noise levels (pipeline.validation_levels): val_loss_t<k> per
    # level, val_loss their mean; each level costs one forward pass over the eval_iters packs.
    eval_noise_bins: int = 8
    eval_sampling_steps: int = 10  # sampler steps of the validation generation
    max_consecutive_nonfinite: int = 5
    exit_signal_handler: bool = True
    collective_timeout_minutes: int = 30  # a stuck collective fails after this, naming the rank
    # A step, validation or save without progress for this long dumps the rank's Python stacks and exits 3
    # (dfm/platform/watchdog.py). null: 30 min on GPUs, off on CPUs; 0: off.
    stall_timeout_s: float | None = None
    # A process still running this long after a stop signal (a save or a collective that never returns)
    # writes its Python stacks and exits 3 (dfm/platform/exit_deadline.py; the stacks also at 20 s). 0: off.
    # Below scripts/slurm/pretrain.sbatch's 120 s of warning; raise it with a launcher's longer grace.
    exit_signal_timeout_s: float = 110.0
    manual_gc_interval: int = 0  # 0: leave Python's GC automatic


@dataclass
class OptimizerConfig:
    """Optimizer hyper-parameters, gradient clipping and EMA."""

    optimizer: Literal["adam", "sgd"] = "adam"
    lr: float = 1e-4
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    ema_decay: float | None = None  # None: no EMA weights


@dataclass
class SchedulerConfig:
    """Learning-rate warmup and decay."""

    lr_warmup_iters: int = 0
    lr_decay_style: LrDecayStyle = "constant"
    lr_decay_iters: int | None = None  # None: train.train_iters

    def decay_iters(self, train_iters: int) -> int:
        """`lr_decay_iters`, or the run length when unset."""
        return self.lr_decay_iters if self.lr_decay_iters is not None else train_iters


@dataclass
class DatasetConfig:
    """Where samples come from (energon path or mock) and how they are packed."""

    path: str | None = None
    seq_length: int = 4096  # packing limit, in video tokens
    packing_buffer_size: int | None = 100
    # cost: packs of about equal FLOPs (linear + attention) so DP ranks and micro-batches do equal
    # work; tokens: the fullest packs. See docs/data.md.
    packing_balance: PackingBalance = "cost"
    skip_bad_samples: bool = False  # True: a malformed sample is skipped, named and counted; False: the run stops
    # True: '.pickle' shard parts through full pickle, which runs any code a shard holds: trusted data only.
    # False: numpy arrays and torch tensors only (docs/data.md).
    allow_pickle: bool = False
    # True: energon may run the Python a dataset's .nv-meta/dataset.yaml names (part_filter, sample_loader,
    # __module__ other than megatron.energon): trusted data only. False: such metadata is refused.
    allow_code: bool = False
    num_workers: int = 2
    # energon's read order: runs of at most max_samples_per_sequence samples of a shard (None: whole shards),
    # mixed through a shuffle buffer of shuffle_buffer_size samples.
    shuffle_buffer_size: int = 100
    max_samples_per_sequence: int | None = 100
    # MiB of decoded, checked samples each loader worker keeps (0: none): small datasets trained for many
    # epochs skip decoding their parts again (dfm/data/energon/cooked_cache.py).
    cooked_cache_mib: int = 0
    mock_image_fraction: float = 0.5
    # Latent sizes: images [H, W], videos [T, H, W].
    mock_image_sizes: list[list[int]] = field(default_factory=lambda: [[16, 16], [32, 32], [16, 32]])
    mock_video_sizes: list[list[int]] = field(default_factory=lambda: [[4, 16, 16], [8, 16, 16]])
    mock_text_len_range: list[int] = field(default_factory=lambda: [8, 32])
    mock_samples_per_pack: int | None = None  # None: fill each pack up to seq_length
    cfg_dropout_prob: float = 0.1
    # HunyuanVideo 1.5: the probability a sample trains image-to-video (first-frame condition), else text-to-video.
    i2v_prob: float = 0.0


@dataclass
class CheckpointConfig:
    """Where and how often to save, and what to resume from."""

    save: str | None = None
    load: str | None = None
    # Initial model weights of a new run (a `convert import` output or any checkpoint, any layout): weights only,
    # fresh optimizer and schedule. Ignored when `load` finds a checkpoint to resume.
    pretrained: str | None = None
    save_interval: int | None = None
    keep_last: int | None = None  # None: keep every checkpoint
    async_save: bool = False
    # An async save whose writer adds no byte to its folder for this long (60 s when its worker processes are
    # gone) is abandoned (stacks logged, the writer stopped, the folder removed, `latest` unchanged) and
    # training goes on; 0: wait as long as it takes.
    async_save_timeout_s: float = 900.0
    # Resume with changed data settings (batch sizes, dataset path, mock/energon, seq_length): refused unless
    # true; then the data position starts over. dfm/checkpoint/run_settings.py.
    allow_setting_changes: bool = False


@dataclass
class LoggerConfig:
    """Console, TensorBoard and Weights & Biases logging."""

    log_dir: str = "outputs/logs"
    log_interval: int = 1
    tensorboard_dir: str | None = None
    wandb_project: str | None = None
    wandb_exp_name: str | None = None


@dataclass
class RNGConfig:
    """Seed for every random stream (model init, mock data, noise)."""

    seed: int = 1234


@dataclass
class DDPConfig:
    """Megatron-core DistributedDataParallel and distributed-optimizer options."""

    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    grad_reduce_in_fp32: bool = True
    average_in_collective: bool = False
    # Fully sharded data parallel (Megatron-Bridge key names); docs/parallelism.md.
    use_megatron_fsdp: bool = False
    data_parallel_sharding_strategy: ShardingStrategy = "no_shard"
    use_torch_fsdp2: bool = False


@dataclass
class MixedPrecisionConfig:
    """Compute precision; fp8 needs Transformer Engine."""

    precision: Precision = "fp32"
    fp8: Fp8Format | None = None


@dataclass
class ValidationConfig:
    """Decoded samples at ``train.eval_interval`` (dfm/training/validation_media.py, docs/training.md
    "Validation"): one file per prompt under ``<logger.log_dir>/validation/iter_<N>/``, also to
    TensorBoard and W&B when those are on."""

    prompts: list[str] = field(default_factory=list)  # none: no decoded samples
    seed: int = 0  # prompt k's noise is drawn from seed + k: the same at every evaluation
    steps: int | None = None  # sampler steps; None: train.eval_sampling_steps
    guidance_scale: float = 5.0  # classifier-free guidance (1: none)
    # [frames, height, width] in pixels per prompt (fewer than prompts: the last repeats); none: the first
    # validation sample's size. frames > 1: an mp4, else a png.
    sizes: list[list[int]] = field(default_factory=list)
    fps: int = 8
    # The text encoder and VAE; None: the ones the dataset's samples record (dfm's preparation writes them).
    t5: str | None = None
    vae: str | None = None
    vae_kind: str = "auto"
    tiny_random_encoders: bool = False  # tiny random T5 and VAE of the model's sizes (tests, smoke runs)
    # Numbers from the decoded samples, by registered name (dfm/training/sample_metrics.py), e.g. pixel_stats.
    metrics: list[str] = field(default_factory=list)
    use_ema: bool = True  # sample from the EMA weights when optimizer.ema_decay keeps them


@dataclass
class ConfigContainer:
    """The whole run configuration, one typed section per concern."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    rng: RNGConfig = field(default_factory=RNGConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)
    # Diffusion settings of the pipeline model.pipeline names (training noise levels, sampler).
    edm: EDMSettings = field(default_factory=EDMSettings)
    flow: FlowSettings = field(default_factory=FlowSettings)
    # LoRA adapters (dfm/peft, docs/lora.md); lora_rank=0: none.
    peft: PeftConfig = field(default_factory=PeftConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    # DMD2 distillation of checkpoint.pretrained into a few-step student (docs/distillation.md); off by default.
    distill: DistillConfig = field(default_factory=DistillConfig)
