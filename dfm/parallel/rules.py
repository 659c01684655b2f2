"""The rules a parallel layout, and a model under it, must meet; checked before any process group starts.

Each rule raises ConfigError naming the sizes and the config key to change (`layout.key`). The rules
read what the protocols below name (a layout, a model, the data-parallel sharding), so that
layout.py imports the rules and nothing here imports the layout or the config.
"""

from __future__ import annotations

from typing import Protocol

from dfm.errors import ConfigError


class Layout(Protocol):
    """The sizes of a layout and what follows from them (``dfm.parallel.layout.ParallelLayout``)."""

    world_size: int
    tp: int
    pp: int
    cp: int
    ep: int
    vpp: int | None
    sp: bool
    dp: int
    model_parallel: int  # tp x pp x cp
    chunks_per_stage: int  # vpp, or 1
    pipeline_stages: int  # pp x chunks_per_stage

    def key(self, name: str) -> str: ...  # the config key to change, e.g. for 'tp'

    def padding_multiples(self) -> tuple[int, int]: ...


class Model(Protocol):
    """What the rules read of a model config (the config's ``ModelConfig``): depth, widths, experts."""

    architecture: str
    num_layers: int
    num_attention_heads: int
    num_moe_experts: int | None
    moe_ffn_hidden_size: int | None
    effective_ffn_hidden_size: int


class Sharding(Protocol):
    """The data-parallel sharding settings (the config's ``DDPConfig``)."""

    use_torch_fsdp2: bool
    use_megatron_fsdp: bool
    data_parallel_sharding_strategy: str


def check_sizes(layout: Layout) -> None:
    """Rules of the sizes alone."""
    for name in ("tp", "pp", "cp", "ep"):
        if getattr(layout, name) < 1:
            raise ConfigError(f"{layout.key(name)} must be >= 1, got {getattr(layout, name)}")
    if layout.vpp is not None and layout.vpp < 1:
        raise ConfigError(f"{layout.key('vpp')} must be >= 1 or null, got {layout.vpp}")
    if layout.world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {layout.world_size}")
    if layout.vpp is not None and layout.pp < 2:
        raise ConfigError(
            f"{layout.key('vpp')}={layout.vpp} needs {layout.key('pp')} >= 2, got {layout.pp}: "
            f"virtual stages interleave the layers of several pipeline stages; set {layout.key('vpp')}=null"
        )
    if layout.sp and layout.tp < 2:
        # megatron's TransformerConfig refuses it too, but only once the process groups run.
        raise ConfigError(
            f"{layout.key('sp')}=true splits the sequence over the tensor-parallel ranks and needs "
            f"{layout.key('tp')} >= 2, got {layout.tp}; set {layout.key('sp')}=false"
        )


def check_world(layout: Layout) -> None:
    """Rules of the sizes on ``layout.world_size`` ranks (``layout.dp`` already derived)."""
    tp, pp, cp, ep = layout.tp, layout.pp, layout.cp, layout.ep
    if layout.world_size % layout.model_parallel:
        raise ConfigError(
            f"world size {layout.world_size} is not divisible by tensor ({tp}) x pipeline ({pp}) x context ({cp}) "
            f"parallel sizes = {layout.model_parallel}: launch a multiple of {layout.model_parallel} ranks "
            f"(torchrun --nproc-per-node x nodes) or change {layout.key('tp')}, {layout.key('pp')} or {layout.key('cp')}"
        )
    # Experts are sharded over the data-parallel x context-parallel ranks of each stage.
    if (layout.dp * cp) % ep:
        raise ConfigError(
            f"{layout.key('ep')} {ep} must divide data-parallel size {layout.dp} x context-parallel size {cp} "
            f"= {layout.dp * cp} (world size {layout.world_size}, tensor {tp}, pipeline {pp}): "
            f"change {layout.key('ep')} or the number of ranks"
        )


def check_model(layout: Layout, model: Model, seq_length: int) -> None:
    """Rules of ``model`` (and its packs of ``seq_length`` tokens) under ``layout``."""
    _check_pipeline_stages(layout, model)
    _check_tensor_parallel_widths(layout, model)
    _check_experts(layout, model)
    _check_context_parallel(layout, model, seq_length)


def _check_pipeline_stages(layout: Layout, model: Model) -> None:
    """Every (virtual) pipeline stage needs the same whole number of layers."""
    if model.num_layers % layout.pipeline_stages:
        raise ConfigError(
            f"model.num_layers ({model.num_layers}) must be a multiple of the pipeline stages: "
            f"{_field(layout, 'pp')} ({layout.pp}) x {_field(layout, 'vpp')} ({layout.chunks_per_stage}) "
            f"= {layout.pipeline_stages}"
        )


def _check_tensor_parallel_widths(layout: Layout, model: Model) -> None:
    """megatron splits attention heads and MLP widths over the TP ranks. (ModelConfig has no
    grouped-query attention: every head has its own K/V, so query groups follow the heads.)"""
    tp = layout.tp
    if model.num_attention_heads % tp:
        raise ConfigError(
            f"model.num_attention_heads ({model.num_attention_heads}) must be divisible by "
            f"{layout.key('tp')} ({tp}): each tensor-parallel rank holds whole heads"
        )
    if model.num_moe_experts and model.moe_ffn_hidden_size is not None:
        key, width = "model.moe_ffn_hidden_size", model.moe_ffn_hidden_size
    else:
        key, width = "model.ffn_hidden_size", model.effective_ffn_hidden_size
    if width % tp:
        raise ConfigError(
            f"{key} ({width}) must be divisible by {layout.key('tp')} ({tp}): the MLP's hidden "
            "width is split over the tensor-parallel ranks"
        )


def _check_experts(layout: Layout, model: Model) -> None:
    experts = model.num_moe_experts
    if not experts:
        if layout.ep > 1:
            raise ConfigError(
                f"{layout.key('ep')} ({layout.ep}) needs an MoE model: set model.num_moe_experts "
                f"or {layout.key('ep')}=1"
            )
        return
    if experts % layout.ep:
        raise ConfigError(
            f"model.num_moe_experts ({experts}) must be divisible by {layout.key('ep')} ({layout.ep}): "
            "each expert-parallel rank holds the same number of whole experts"
        )
    if layout.tp > 1 and not layout.sp:
        # megatron's MoE layer raises this at the first training step otherwise.
        raise ConfigError(
            f"model.num_moe_experts ({experts}) with {layout.key('tp')} ({layout.tp}) needs "
            f"{layout.key('sp')}=true: megatron's MoE layer trains with tensor parallelism only under "
            "sequence parallelism"
        )


def _check_context_parallel(layout: Layout, model: Model, seq_length: int) -> None:
    """Each sample is cut into 2*cp chunks (load balance), each CP share split over TP under SP;
    ST-DiT's all-to-all gives every CP rank heads/(tp*cp) whole heads."""
    cp, tp = layout.cp, layout.tp
    if cp == 1:
        return
    _, multiple = layout.padding_multiples()
    split = f"2 x {_field(layout, 'cp')} ({cp})" + (f" x {_field(layout, 'tp')} ({tp})" if layout.sp else "")
    problem = (
        "is too short to split" if seq_length < multiple else "is not divisible" if seq_length % multiple else None
    )
    if problem:
        raise ConfigError(
            f"dataset.seq_length ({seq_length}) {problem}: context parallelism pads every sample to a multiple of "
            f"{split} = {multiple} tokens and needs seq_length a multiple of it"
        )
    if model.architecture == "stdit" and model.num_attention_heads % (tp * cp):
        raise ConfigError(
            f"model.num_attention_heads ({model.num_attention_heads}) must be divisible by "
            f"{_field(layout, 'tp')} ({tp}) x {_field(layout, 'cp')} ({cp}): stdit re-shards attention heads "
            "over the context-parallel ranks"
        )


def _field(layout: Layout, name: str) -> str:
    """The size's ModelConfig field name: its key without the 'model.' section."""
    return layout.key(name).removeprefix("model.")


TORCH_FSDP2_REFUSED = (
    "ddp.use_torch_fsdp2=true is not supported: megatron-core 0.16.1's TorchFullyShardedDataParallel stops at "
    "the first step on every device (finalize_model_grads calls finish_grad_sync(force_all_reduce=...), which "
    "its base class does not take), its DDP config has no such key, and its DTensor weights do not fit "
    "megatron's checkpoint and optimizer paths; use ddp.use_megatron_fsdp=true "
    "ddp.data_parallel_sharding_strategy=optim_grads_params (docs/parallelism.md)"
)


def check_data_parallel_sharding(ddp: Sharding, layout: Layout) -> None:
    """Fully sharded data parallel: Megatron-FSDP only, without pipeline stages."""
    if ddp.use_torch_fsdp2:
        raise ConfigError(TORCH_FSDP2_REFUSED)
    if not ddp.use_megatron_fsdp:
        if ddp.data_parallel_sharding_strategy != "no_shard":
            raise ConfigError(
                f"ddp.data_parallel_sharding_strategy={ddp.data_parallel_sharding_strategy!r} shards only under "
                "Megatron-FSDP: set ddp.use_megatron_fsdp=true (or ddp.use_distributed_optimizer=true to shard "
                "the optimizer state alone)"
            )
        return
    _check_sharded_gradient_groups(ddp, layout)
    if layout.pp > 1:
        raise ConfigError(
            f"ddp.use_megatron_fsdp=true with {layout.key('pp')} ({layout.pp}) is not supported: FSDP here "
            f"shards over data parallel and combines with TP, SP, CP and EP; set {layout.key('pp')}=1 or "
            "ddp.use_megatron_fsdp=false (the distributed optimizer works with pipeline stages)"
        )


def _check_sharded_gradient_groups(ddp: Sharding, layout: Layout) -> None:
    """megatron-core 0.16.1's Megatron-FSDP reduce-scatters a gradient bucket it does not shard (a
    group of one rank) onto itself and then adds the result to the same memory: those gradients
    come out doubled (measured: MovieGen's experts at EP = DP x CP = 2). Every gradient group
    must therefore span >= 2 ranks: DP x CP for dense weights, DP x CP / EP for experts."""
    shards = layout.dp * layout.cp
    if shards < 2:
        raise ConfigError(
            f"ddp.use_megatron_fsdp=true needs data-parallel x context-parallel size >= 2, got {shards} "
            f"({layout.world_size} ranks): megatron-core 0.16.1 doubles the gradients of a group of one rank; "
            "launch more ranks or set ddp.use_megatron_fsdp=false"
        )
    if layout.ep > 1 and shards // layout.ep < 2:
        raise ConfigError(
            f"ddp.use_megatron_fsdp=true with {layout.key('ep')} ({layout.ep}) = data-parallel x "
            f"context-parallel size ({shards}) leaves each expert on one rank, and megatron-core 0.16.1's "
            "Megatron-FSDP doubles the gradients of such a one-rank group: use "
            f"{layout.key('ep')} <= {shards // 2}, or the distributed optimizer (ddp.use_megatron_fsdp=false)"
        )
