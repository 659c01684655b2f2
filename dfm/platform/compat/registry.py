"""Every patch dfm applies (megatron-core, torch, energon), as records: target, why, and the source it relies on.

``install()`` applies them in this order; ``uninstall()`` restores them in reverse. To add one, see
docs/device_layer.md ("Adding a patch"). All module paths are megatron-core 0.16.1.
"""

from __future__ import annotations

from dfm.platform.compat import (
    async_save,
    checkpointing,
    dynamo_on_demand,
    fsdp,
    gloo_reduce,
    moe,
    optimizer,
    p2p,
    rng,
    safe_loading,
)
from dfm.platform.compat.devices import cpu_torch_view
from dfm.platform.compat.patch import Patch

CURRENT_DEVICE = "torch.cuda.current_device()"


def _torch_view(module: str, site: str, snippet: str, why: str) -> Patch:
    """The module's global ``torch`` becomes the CPU view; ``site`` is one call site it serves."""
    return Patch(
        name=f"torch-view:{module.removeprefix('megatron.core.')}",
        module=module,
        attribute="torch",
        why=why,
        relies_on=(snippet,),
        replace=cpu_torch_view,
        site=site,
    )


TORCH_VIEWS = (
    _torch_view("megatron.core.utils", "GlobalMemoryBuffer.get_tensor", CURRENT_DEVICE, "attention scratch buffer"),
    _torch_view(
        "megatron.core.transformer.dot_product_attention",
        "DotProductAttention.__init__",
        CURRENT_DEVICE,
        "softmax offset on the current CUDA device",
    ),
    _torch_view(
        "megatron.core.transformer.attention", "Attention._allocate_memory", CURRENT_DEVICE, "KV-cache buffers"
    ),
    _torch_view(
        "megatron.core.transformer.utils",
        "get_default_causal_mask",
        'torch.ones(sq, sq, device="cuda")',
        "causal masks built on a device='cuda' literal",
    ),
    _torch_view(
        "megatron.core.transformer.transformer_layer",
        "TransformerLayer.get_layer_static_inputs",
        CURRENT_DEVICE,
        "static inputs on the current CUDA device",
    ),
    _torch_view(
        "megatron.core.tensor_parallel.layers",
        "ColumnParallelLinear.__init__",
        "device=torch.cuda.current_device()",
        "TP weights allocated on the current CUDA device",
    ),
    _torch_view(
        "megatron.core.tensor_parallel.mappings",
        "_gather_along_first_dim",
        "device=torch.cuda.current_device()",
        "TP/SP all-gather and reduce-scatter buffers",
    ),
    _torch_view(
        "megatron.core.tensor_parallel.utils",
        "gather_split_1d_tensor",
        "device=torch.cuda.current_device()",
        "1-D split/gather buffers",
    ),
    _torch_view(
        "megatron.core.tensor_parallel.data",
        "broadcast_data",
        "device=torch.cuda.current_device()",
        "broadcast buffers",
    ),
    _torch_view(
        "megatron.core.tensor_parallel.random",
        "CudaRNGStatesTracker.add",
        "torch.cuda.manual_seed(seed)",
        "the tracker's RNG states live in CUDA generators",
    ),
    _torch_view(
        "megatron.core.distributed.distributed_data_parallel",
        "DistributedDataParallel.__init__",
        "torch.cuda.Stream(device=torch.cuda.current_device())",
        "DDP's communication stream",
    ),
    _torch_view(
        "megatron.core.distributed.param_and_grad_buffer",
        "_ParamAndGradBucketGroup.start_grad_sync",
        "torch.cuda.stream(self.communication_stream)",
        "grad-sync streams and param/grad buffers",
    ),
    _torch_view(
        "megatron.core.optimizer.optimizer",
        "MixedPrecisionOptimizer.__init__",
        "device='cuda'",
        "found_inf and loss-scale scalars",
    ),
    _torch_view("megatron.core.optimizer.clip_grads", "get_grad_norm_fp32", "device='cuda'", "grad-norm scalars"),
    _torch_view(
        "megatron.core.optimizer.distrib_optimizer",
        "DistributedOptimizer.load_state_dict",
        CURRENT_DEVICE,
        "distributed-optimizer buffers",
    ),
    _torch_view(
        "megatron.core.optimizer.grad_scaler", "MegatronGradScaler.__init__", "device='cuda'", "loss-scale scalars"
    ),
    _torch_view(
        "megatron.core.pipeline_parallel.schedules",
        "forward_backward_pipelining_without_interleaving",
        'total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")',
        "token counters",
    ),
    _torch_view("megatron.core.models.gpt.gpt_model", "GPTModel._preprocess", CURRENT_DEVICE, "inference offsets"),
    _torch_view(
        "megatron.core.models.common.embeddings.rotary_pos_embedding",
        "RotaryEmbedding.__init__",
        CURRENT_DEVICE,
        "rotary frequencies",
    ),
    _torch_view("megatron.core.transformer.moe.router", "TopKRouter.__init__", CURRENT_DEVICE, "router buffers"),
    _torch_view("megatron.core.transformer.moe.experts", "GroupedMLP.__init__", CURRENT_DEVICE, "expert weights"),
    _torch_view(
        "megatron.core.transformer.moe.shared_experts",
        "SharedExpertMLP.__init__",
        "torch.cuda.Stream()",
        "shared-expert stream",
    ),
    _torch_view(
        "megatron.core.transformer.moe.token_dispatcher",
        "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize",
        "torch.cuda.current_stream()",
        "alltoall dispatcher's device-to-host stream",
    ),
    _torch_view("megatron.core.transformer.moe.moe_utils", "track_moe_metrics", 'device="cuda"', "MoE metrics"),
    _torch_view(
        "megatron.core.dist_checkpointing.strategies.state_dict_saver",
        "verify_global_md_reuse",
        "device='cuda'",
        "verification flags",
    ),
    _torch_view(
        "megatron.core.dist_checkpointing.strategies.filesystem_async",
        "FileSystemWriterAsync.preload_tensors",
        "torch.cuda.synchronize()",
        "synchronize before writing",
    ),
    _torch_view(
        "megatron.core.dist_checkpointing.strategies.async_utils",
        "AsyncCaller.sync_all_async_calls",
        CURRENT_DEVICE,
        "async-save flags",
    ),
    _torch_view(
        "megatron.core.dist_checkpointing.strategies.fully_parallel",
        "FullyParallelLoadStrategyWrapper.load",
        "torch.cuda.synchronize()",
        "synchronize after loading",
    ),
    _torch_view(
        "megatron.core.dist_checkpointing.exchange_utils",
        "_get_empty_tensor_for_exchange",
        'device="cuda"',
        "exchange buffers",
    ),
)

RNG = (
    Patch(
        name="rng-set-state",
        module="megatron.core.tensor_parallel.random",
        attribute="_set_cuda_rng_state",
        why="sets torch.cuda.default_generators[idx] through _lazy_call: no CPU generator behind it",
        relies_on=("default_generator = torch.cuda.default_generators[idx]", "_lazy_call(cb)"),
        replace=rng.set_cpu_rng_state,
    ),
    Patch(
        name="rng-tracker-fork",
        module="megatron.core.tensor_parallel.random",
        attribute="CudaRNGStatesTracker.fork",
        why="warns 'CPU RNG state changed' on every fork, because on CPU the tracked generator is the CPU one",
        relies_on=(
            "cpu_rng_state = torch.get_rng_state()",
            f"logging.getLogger(__name__).warning('{rng.FORK_WARNING}')",
        ),
        replace=rng.fork_without_cpu_state_warning,
    ),
)

OPTIMIZER = (
    Patch(
        name="cuda-type-names:float16-optimizer",
        module="megatron.core.optimizer.optimizer",
        attribute="Float16OptimizerWithFloat16Params.__init__",
        why="sorts parameters by param.type() == 'torch.cuda.FloatTensor' and rejects CPU tensors",
        relies_on=("param.type() == 'torch.cuda.FloatTensor'",),
        replace=optimizer.with_cuda_type_names,
    ),
    Patch(
        name="cuda-type-names:distributed-optimizer",
        module="megatron.core.optimizer.distrib_optimizer",
        attribute="DistributedOptimizer._build_model_and_main_param_groups",
        why="sorts parameters by model_param.type() == 'torch.cuda.FloatTensor' and rejects CPU tensors",
        relies_on=("model_param.type() == 'torch.cuda.FloatTensor'",),
        replace=optimizer.with_cuda_type_names,
    ),
    Patch(
        name="clip-grads-dtype-check",
        module="megatron.core.optimizer.clip_grads",
        attribute="clip_grad_by_total_norm_fp32",
        why="asserts param.grad.type() == 'torch.cuda.FloatTensor', and walks every gradient when nothing is clipped",
        relies_on=(
            "assert param.grad.type() == 'torch.cuda.FloatTensor'",
            "clip_coeff = max_norm / (total_norm + 1.0e-6)",
            "if clip_coeff < 1.0:",
            "multi_tensor_applier( multi_tensor_scale_impl, dummy_overflow_buf, [grads, grads], clip_coeff )",
        ),
        replace=optimizer.clip_checking_dtypes,
        also_bound_in=("megatron.core.optimizer.optimizer",),
    ),
    Patch(
        name="foreach-l2-norm",
        module="megatron.core.optimizer.clip_grads",
        attribute="l2_norm_impl",
        why="without Apex / TE the gradient norm reads each parameter's norm to the host (a sync each on a GPU)",
        relies_on=("grad_norm, _ = multi_tensor_applier( l2_norm_impl,",),
        replace=optimizer.foreach_l2_norm,
        site="get_grad_norm_fp32",
        cpu_only=False,
    ),
    Patch(
        name="grad-norm-alone",
        module="megatron.core.optimizer.clip_grads",
        attribute="get_grad_norm_fp32",
        why="all-reduces the squared norm over its group even when the group is this one rank",
        relies_on=(
            "grad_norm, _ = multi_tensor_applier( l2_norm_impl, dummy_overflow_buf, [grads_for_norm],",
            "total_norm = grad_norm**norm_type",
            "torch.distributed.all_reduce( total_norm, op=torch.distributed.ReduceOp.SUM, group=grad_stats_parallel_group )",
            "total_norm = total_norm.item() ** (1.0 / norm_type)",
        ),
        replace=optimizer.l2_grad_norm_alone_skips_the_reduce,
        also_bound_in=("megatron.core.optimizer.optimizer", "megatron.core.optimizer.layer_wise_optimizer"),
    ),
)

MOE = (
    Patch(
        name="moe-te-general-gemm",
        module="megatron.core.transformer.moe.moe_utils",
        attribute="te_general_gemm",
        why="bound only when Transformer Engine imports, yet the router tests it against None",
        relies_on=("if te_general_gemm is not None",),
        replace=moe.none_if_missing,
        site="RouterGatingLinearFunction.forward",
    ),
    Patch(
        name="moe-split-sizes-to-host",
        module="megatron.core.transformer.moe.moe_utils",
        attribute="maybe_move_tensor_to_cpu",
        why="converts only CUDA tensors to numpy; CPU alltoall split sizes stay tensors",
        relies_on=("if torch.is_tensor(tensor) and tensor.is_cuda:",),
        replace=moe.split_sizes_as_numpy,
        also_bound_in=("megatron.core.transformer.moe.token_dispatcher",),
    ),
)

# The order megatron builds its p2p ops in, which the announced tags follow (p2p.py).
P2P_OP_ORDER = (
    "ops.append(send_prev_op)",
    "ops.append(recv_prev_op)",
    "ops.append(send_next_op)",
    "ops.append(recv_next_op)",
)

PIPELINE_P2P = (
    Patch(
        name="p2p-gloo-batch",
        module="megatron.core.pipeline_parallel.p2p_communication",
        attribute="torch",
        why="the CPU view, whose batch_isend_irecv tags each direction and does not block on sends",
        relies_on=("reqs = torch.distributed.batch_isend_irecv(ops)", "torch.distributed.isend, tensor_send_prev"),
        replace=p2p.gloo_torch_view,
        site="_batched_p2p_ops",
    ),
    Patch(
        name="p2p-announce-batched-ops",
        module="megatron.core.pipeline_parallel.p2p_communication",
        attribute="_batched_p2p_ops",
        why="tells the gloo batch which directions its ops are (prev and next are one rank at PP=2)",
        relies_on=P2P_OP_ORDER,
        replace=p2p.announcing_batched_ops,
    ),
    Patch(
        name="p2p-announce-shapes",
        module="megatron.core.pipeline_parallel.p2p_communication",
        attribute="P2PCommunicator._communicate_shapes",
        why="tells the gloo batch which directions the shape ops are",
        relies_on=(*P2P_OP_ORDER, "reqs = torch.distributed.batch_isend_irecv(ops)"),
        replace=p2p.announcing_shapes,
    ),
    *(
        Patch(
            name=f"p2p-wait-sends:{schedule.removeprefix('forward_backward_')}",
            module="megatron.core.pipeline_parallel.schedules",
            attribute=schedule,
            why="waits the sends the gloo batch deferred, once the schedule has posted every receive",
            relies_on=("p2p_communicator.",),
            replace=p2p.waiting_for_sends,
        )
        for schedule in (
            "forward_backward_pipelining_with_interleaving",
            "forward_backward_pipelining_without_interleaving",
        )
    ),
)

# The distributed optimizer's gradient reduce-scatter and parameter all-gather (gloo_reduce.py).
DISTRIBUTED_OPTIMIZER_COLLECTIVES = (
    Patch(
        name="gloo-reduce-scatter-in-place",
        module="megatron.core.distributed.param_and_grad_buffer",
        attribute="dist_reduce_scatter_func",
        why="gloo's reduce_scatter_tensor copies its input: with one bucket, every gradient of the model",
        relies_on=(
            "self.cached_grad_buffer_shard_list[idx] = shard_buffer(",
            "grad_reduce_handle = dist_reduce_scatter_func( local_data_view, bucket.grad_data,",
        ),
        replace=gloo_reduce.reduce_scatter_in_place_on_gloo,
        site="_ParamAndGradBucketGroup.start_grad_sync",
    ),
    Patch(
        name="gloo-all-gather-in-place",
        module="megatron.core.distributed.param_and_grad_buffer",
        attribute="dist_all_gather_func",
        why="gloo's all_gather_into_tensor copies its output: with one bucket, every parameter of the model",
        relies_on=(
            "self.cached_param_buffer_shard_list[idx] = shard_buffer(",
            "dist_all_gather_func( bucket.param_data, local_data_view,",
        ),
        replace=gloo_reduce.all_gather_in_place_on_gloo,
        site="_ParamAndGradBucketGroup.start_param_sync",
    ),
)

MEGATRON_FSDP_SRC = "megatron.core.distributed.fsdp.src.megatron_fsdp"

MEGATRON_FSDP = (
    Patch(
        name="torch-view:megatron-fsdp",
        module=f"{MEGATRON_FSDP_SRC}.megatron_fsdp",
        attribute="torch",
        why="names its device torch.device(f'cuda:{current_device}') and makes side streams",
        relies_on=('torch.device(f"cuda:{torch.cuda.current_device()}")',),
        replace=fsdp.cpu_device_torch_view,
        site="MegatronFSDP.__init__",
    ),
    Patch(
        name="torch-view:megatron-fsdp-buffers",
        module=f"{MEGATRON_FSDP_SRC}.param_and_grad_buffer",
        attribute="torch",
        why="reduce-scatter / all-gather streams and their synchronization",
        relies_on=("with torch.cuda.stream(reduce_scatter_stream):",),
        replace=fsdp.cpu_device_torch_view,
        site="GradReducePipeline._bucket_group_gradient_reduce",
    ),
    Patch(
        name="megatron-fsdp-uneven-check",
        module=f"{MEGATRON_FSDP_SRC}.uneven_dtensor",
        attribute="validate_uneven_dtensor",
        why="copies its boundary flags to the GPU with .cuda() before all-reducing them",
        relies_on=(").cuda()",),
        replace=fsdp.without_cuda_copies,
        also_bound_in=(f"{MEGATRON_FSDP_SRC}.param_and_grad_buffer",),
    ),
    Patch(
        name="torch-view:megatron-fsdp-adapter",
        module="megatron.core.distributed.fsdp.mcore_fsdp_adapter",
        attribute="torch",
        why="syncs the CUDA RNG state over the TP group (torch.cuda.get_rng_state / set_rng_state)",
        relies_on=("'cuda_rng_state': torch.cuda.get_rng_state(),",),
        replace=fsdp.cpu_device_torch_view,
        site="_get_rng_state_dict",
    ),
    Patch(
        name="megatron-fsdp-cpu-mesh",
        module="megatron.core.distributed.fsdp.mcore_fsdp_adapter",
        attribute="DeviceMesh",
        why="builds its data-parallel x tensor-parallel meshes with device_type='cuda'",
        relies_on=('device_type="cuda"', "DeviceMesh.from_group("),
        replace=fsdp.meshes_on_cpu,
        site="FullyShardedDataParallel._init_dist_index",
    ),
    Patch(
        name="megatron-fsdp-te-linear",
        module="megatron.core.distributed.fsdp.mcore_fsdp_adapter",
        attribute="TELinear",
        why="without Transformer Engine TELinear is a MagicMock, and isinstance(module, (TELinear,)) raises under TP",
        relies_on=("isinstance(direct_module, (TELinear,))",),
        replace=fsdp.te_linear_or_placeholder,
        site="FullyShardedDataParallel._fix_tensor_parallel_attributes",
        cpu_only=False,
    ),
    Patch(
        name="megatron-fsdp-root-hooks",
        module=f"{MEGATRON_FSDP_SRC}.megatron_fsdp",
        attribute="MegatronFSDP.forward",
        why="calls self.module.forward, so the root pre-backward hook fires only from the last-registered "
        "submodule; when that one's gradient comes late, the gradients reduced before it are reduced again",
        relies_on=(
            "self._replace_param_with_raw_if_needed()",
            'with torch.autograd.profiler.record_function("CustomFSDP.forward"):',
            "output = self.module.forward(*inputs, **kwargs)",
        ),
        replace=fsdp.forward_through_root_hooks,
        cpu_only=False,
    ),
    Patch(
        name="megatron-fsdp-stand-in-parameters",
        module=f"{MEGATRON_FSDP_SRC}.megatron_fsdp",
        attribute="MegatronFSDP.stand_in_parameters",
        why="dfm's checkpoint templates need the raw parameters at their TP-local shapes while FSDP's buckets "
        "are freed, without the state-dict pre-hook swapping the DTensor shards back in",
        relies_on=(
            "def _replace_param_with_raw_if_needed(self): if not self.is_param_fsdp_distributed: return",
            "def _replace_param_with_distributed_if_needed(self): if self.is_param_fsdp_distributed: return",
            "register_state_dict_pre_hook( lambda *args, **kwargs: self._replace_param_with_distributed_if_needed() )",
        ),
        replace=fsdp.stand_in_parameters,
        site="MegatronFSDP",
        cpu_only=False,
    ),
)


def _distopt_accessor(public: str, private: str, *relies_on: str) -> Patch:
    """``DistributedOptimizer.<public>`` added, calling the private method ``private`` (a signature)
    through which dfm's checkpoint reads and loads each parameter's main weight and Adam moments."""
    return Patch(
        name=f"distrib-optimizer-{public.replace('_', '-')}",
        module="megatron.core.optimizer.distrib_optimizer",
        attribute=f"DistributedOptimizer.{public}",
        why=f"dfm's checkpoint needs the per-parameter state that only the private {private.split('(')[0]} gives",
        relies_on=(f"def {private}:", *relies_on),
        replace=checkpointing.calling(private.split("(")[0]),
        site="DistributedOptimizer",
        cpu_only=False,
    )


# Not about the device: megatron's checkpointing with torch's Adam (no Apex / TE), applied on CUDA too.
CHECKPOINTING = (
    Patch(
        name="distrib-optimizer-step-copy",
        module="megatron.core.optimizer.distrib_optimizer",
        attribute="DistributedOptimizer._set_main_param_and_optimizer_states",
        why="copies every optimizer-state key, but the fully-reshardable loader does not give torch Adam's 'step'",
        relies_on=('dst_tensors = {"param": main_param, **optim_state}', "dst_tensors[key].copy_(tensors[key])"),
        replace=checkpointing.copying_given_keys_only,
        cpu_only=False,
    ),
    _distopt_accessor(
        "param_states", "_get_main_param_and_optimizer_states(self, model_param)", 'tensors = {"param": main_param'
    ),
    _distopt_accessor("set_param_states", "_set_main_param_and_optimizer_states(self, model_param, tensors)"),
    Patch(
        name="async-save-results-queue",
        module="megatron.core.dist_checkpointing.strategies.filesystem_async",
        attribute="_get_write_results_queue",
        why="spawns the writers' result-queue server lazily; dfm's own (dies with the rank, outlives stop "
        "signals: dfm/platform/parent_watch.py) is to be used instead",
        relies_on=("_results_queue = ctx.Manager().Queue()", "return _results_queue"),
        replace=async_save.dfm_queue_first,
        cpu_only=False,
    ),
)

# Not about the device: files are data, never code. torch distributed checkpoint (which megatron's
# dist_checkpointing reads through) unpickles metadata and per-rank objects with full pickle.
DCP = "torch.distributed.checkpoint"

SAFE_LOADING = (
    Patch(
        name="safe-checkpoint-metadata",
        module=f"{DCP}.filesystem",
        attribute="pickle",
        why="reads a checkpoint's .metadata with pickle.load: a crafted file would run code",
        relies_on=("metadata = pickle.load(metadata_file)",),
        replace=safe_loading.metadata_pickle_view,
        site="FileSystemReader.read_metadata",
        cpu_only=False,
    ),
    Patch(
        name="safe-checkpoint-objects",
        module=f"{DCP}.default_planner",
        attribute="DefaultLoadPlanner.load_bytes",
        why="reads per-rank objects (RNG state, data position) with torch.load(weights_only=False)",
        relies_on=(
            "torch.load(value, weights_only=False)",
            "self.mappings[read_item.dest_index.fqn]",
            "self.state_dict[read_item.dest_index.fqn] = torch.load(",
        ),
        replace=safe_loading.objects_as_data,
        cpu_only=False,
    ),
    Patch(
        name="safe-common-state",
        module="megatron.core.dist_checkpointing.strategies.common",
        attribute="TorchCommonLoadStrategy.load_common",
        why="reads common.pt with a plain torch.load: TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 makes it full pickle",
        relies_on=(
            "load_path = os.path.join(checkpoint_dir, COMMON_STATE_FNAME)",
            "torch.load(load_path, map_location='cpu')",
        ),
        replace=safe_loading.weights_only_common,
        cpu_only=False,
    ),
    Patch(
        name="safe-checkpoint-objects-named",
        module=f"{DCP}.filesystem",
        attribute="FileSystemReader.read_data",
        why="knows the checkpoint directory that a refused per-rank object's message must name",
        relies_on=("planner.load_bytes(req, read_bytes)",),
        replace=safe_loading.refusals_name_the_directory,
        cpu_only=False,
    ),
)


# Not about the device: start-up cost. torch's optimizers import dynamo on their first call (~1 s of
# CPU in every training rank) to keep it out of methods it cannot be tracing until it is imported.
def _until_dynamo(attribute: str) -> Patch:
    return Patch(
        name=f"no-dynamo-import:{attribute}",
        module="torch.optim.optimizer",
        attribute=f"Optimizer.{attribute}",
        why="imports torch._dynamo on its first call, only to disable it around the method",
        relies_on=("@torch._disable_dynamo",),
        replace=dynamo_on_demand.undecorated_until_dynamo,
        cpu_only=False,
    )


def _step_until_dynamo(module: str, cls: str) -> Patch:
    return Patch(
        name=f"no-dynamo-import:{cls}.step",
        module=module,
        attribute=f"{cls}.step",
        why="imports torch._dynamo on every call for graph breaks that do nothing outside a trace",
        relies_on=("@_use_grad_for_differentiable",),
        replace=dynamo_on_demand.step_until_dynamo,
        cpu_only=False,
    )


DYNAMO_ON_DEMAND = (
    *(_until_dynamo(name) for name in ("add_param_group", "zero_grad", "state_dict", "load_state_dict")),
    _step_until_dynamo("torch.optim.adam", "Adam"),
    _step_until_dynamo("torch.optim.sgd", "SGD"),
)

PATCHES = (
    *TORCH_VIEWS,
    *RNG,
    *OPTIMIZER,
    *MOE,
    *PIPELINE_P2P,
    *DISTRIBUTED_OPTIMIZER_COLLECTIVES,
    *MEGATRON_FSDP,
    *CHECKPOINTING,
    *SAFE_LOADING,
    *DYNAMO_ON_DEMAND,
)
