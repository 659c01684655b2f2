"""Run megatron-core training components on CPU (gloo); do nothing on CUDA.

megatron-core 0.16.1 assumes CUDA at a known set of call sites: it allocates with
``device=torch.cuda.current_device()`` or ``device="cuda"``, creates ``torch.cuda.Stream``s,
keeps its tensor-parallel RNG in CUDA generators and classifies parameters by the CUDA type
name (``'torch.cuda.FloatTensor'``). ``enable_cpu_support()`` fixes exactly those sites:

* Most sites only need "the current device", so the ``torch`` global of each listed megatron
  module is replaced by a view of torch whose ``cuda`` namespace answers for the CPU (see
  ``_CpuTorchView``). torch itself and every other module are left untouched.
* The rest are single functions replaced in their own megatron module (``_patch_*`` below).

Every patch names the megatron-core function it replaces and why, and the whole set is
checked against the installed megatron-core version before anything is applied.
See docs/device_layer.md for the table of sites.
"""

import contextlib
import copy
import functools
import importlib
import os

import torch

SUPPORTED_MEGATRON_CORE_VERSIONS = ("0.16.1",)

_applied = False  # the "already applied" guard; enable_cpu_support() is idempotent


def compute_device() -> torch.device:
    """The device this process computes on: ``cuda:LOCAL_RANK`` when CUDA exists, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def enable_cpu_support() -> None:
    """Make megatron-core usable on CPU; a no-op when CUDA is available or when already applied.

    Raises RuntimeError on a megatron-core version the patches were not written for.
    """
    global _applied
    if _applied or torch.cuda.is_available():
        return
    _check_megatron_core_version()
    for module_name in _MODULES_USING_CURRENT_CUDA_DEVICE:
        _point_module_torch_at_cpu(module_name)
    for patch in _FUNCTION_PATCHES:
        patch()
    _applied = True


def cpu_support_enabled() -> bool:
    """Whether enable_cpu_support() has patched megatron-core in this process."""
    return _applied


def _check_megatron_core_version() -> None:
    from megatron.core.package_info import __version__

    if __version__ not in SUPPORTED_MEGATRON_CORE_VERSIONS:
        raise RuntimeError(
            f"dfm's CPU device layer was written for megatron-core "
            f"{', '.join(SUPPORTED_MEGATRON_CORE_VERSIONS)}, but {__version__} is installed. "
            f"The patched call sites (docs/device_layer.md) may have moved: re-check them and "
            f"add the version to SUPPORTED_MEGATRON_CORE_VERSIONS in dfm/platform/device.py, "
            f"or run on CUDA where no patch is applied."
        )


# --------------------------------------------------------------------------------------------
# A per-module view of torch whose CUDA namespace answers for the CPU.
# --------------------------------------------------------------------------------------------


def _cpu_if_cuda(device):
    """Map any CUDA device spelling (``"cuda"``, ``"cuda:1"``, ``0``, torch.device) to CPU."""
    if device is None:
        return None
    if isinstance(device, int) or torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


class _NoOpStream:
    """Stands in for torch.cuda.Stream and torch.cuda.Event: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else _NoOpStream()

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _CpuCudaNamespace:
    """What ``torch.cuda`` means inside a patched megatron module on a CPU-only machine."""

    Stream = _NoOpStream
    Event = _NoOpStream

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def is_available():
        return False

    @staticmethod
    def current_device():
        return torch.device("cpu")

    @staticmethod
    def device_count():
        return 0

    @staticmethod
    def stream(stream=None):
        return contextlib.nullcontext()

    @staticmethod
    def current_stream(device=None):
        return _NoOpStream()

    default_stream = current_stream

    @staticmethod
    def synchronize(device=None):
        pass

    @staticmethod
    def get_rng_state(device="cuda"):
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(new_state, device="cuda"):
        torch.set_rng_state(new_state)

    @staticmethod
    def manual_seed(seed):
        torch.manual_seed(seed)

    @property
    def random(self):
        return self  # torch.cuda.random.get_rng_state(...) -> the CPU generator


def _cpu_factory(factory):
    """Wrap a tensor factory so ``device="cuda"`` (a literal at several sites) means CPU."""

    def on_cpu(*args, device=None, **kwargs):
        return factory(*args, device=_cpu_if_cuda(device), **kwargs)

    on_cpu.__name__ = factory.__name__
    return on_cpu


_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "empty_like", "zeros_like")


class _CpuTorchView:
    """torch, except that ``cuda`` and the tensor factories answer for the CPU."""

    def __init__(self):
        self.cuda = _CpuCudaNamespace()
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


def _point_module_torch_at_cpu(module_name: str) -> None:
    module = importlib.import_module(module_name)
    if getattr(module, "torch", None) is not torch:
        raise RuntimeError(
            f"{module_name} no longer binds the global name 'torch' to the torch module; "
            f"the CPU device layer does not match this megatron-core version."
        )
    module.torch = _CpuTorchView()


# Modules whose CUDA assumptions are only "the current device" / streams / CUDA RNG / a
# literal device="cuda". Their global ``torch`` becomes a _CpuTorchView (megatron-core 0.16.1).
_MODULES_USING_CURRENT_CUDA_DEVICE = (
    # GlobalMemoryBuffer.get_tensor: the attention matmul scratch buffer
    "megatron.core.utils",
    # attention mask and inference buffers: DotProductAttention.forward, TransformerLayer
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.utils",  # get_default_causal_mask: device="cuda"
    "megatron.core.transformer.transformer_layer",
    # weight allocation and sequence-parallel gather/scatter buffers
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.tensor_parallel.data",
    # RNG tracker: CUDA generator state -> the CPU generator
    "megatron.core.tensor_parallel.random",
    # DDP communication stream and grad buffers
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.param_and_grad_buffer",
    # optimizer scalars (found_inf, loss scale), grad norm buffers, distributed-optimizer buffers
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.grad_scaler",
    # pipeline schedules: token counters, p2p shape and receive buffers
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    # GPT model inference offsets and rotary embeddings
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    # MoE: router/expert buffers, shared-expert and alltoall-dispatcher streams
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.shared_experts",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.moe_utils",
    # dist_checkpointing: verification/exchange flags, synchronize before writing
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.exchange_utils",
)


# --------------------------------------------------------------------------------------------
# Single-function patches.
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _cuda_type_names():
    """Let ``Tensor.type()`` report CPU tensors under their CUDA names for one call.

    megatron classifies parameters by comparing ``param.type()`` with
    ``'torch.cuda.FloatTensor'`` etc.; only the dtype part of that name matters to it.
    """
    original = torch.Tensor.type

    def type_with_cuda_name(tensor, dtype=None, non_blocking=False, **kwargs):
        if dtype is not None:
            return original(tensor, dtype, non_blocking, **kwargs)
        name = original(tensor)
        if tensor.device.type == "cpu" and name.startswith("torch.") and "cuda" not in name:
            return "torch.cuda." + name[len("torch.") :]
        return name

    torch.Tensor.type = type_with_cuda_name
    try:
        yield
    finally:
        torch.Tensor.type = original


def _with_cuda_type_names(function):
    def wrapped(*args, **kwargs):
        with _cuda_type_names():
            return function(*args, **kwargs)

    wrapped.__wrapped__ = function
    wrapped.__name__ = function.__name__
    wrapped.__doc__ = function.__doc__
    return wrapped


def _patch_param_type_checks() -> None:
    """megatron.core.optimizer: parameter classification by CUDA type name (0.16.1).

    ``Float16OptimizerWithFloat16Params.__init__``,
    ``DistributedOptimizer._build_model_and_main_param_groups`` and
    ``clip_grads.clip_grad_by_total_norm_fp32`` compare ``param.type()`` with
    ``'torch.cuda.FloatTensor'`` / ``HalfTensor`` / ``BFloat16Tensor`` and reject CPU
    parameters. Each is wrapped so that, during its call only, CPU tensors report CUDA names.
    """
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    f16 = optimizer.Float16OptimizerWithFloat16Params
    f16.__init__ = _with_cuda_type_names(f16.__init__)
    dist = distrib_optimizer.DistributedOptimizer
    build_groups = dist.__dict__["_build_model_and_main_param_groups"].__func__  # a classmethod
    dist._build_model_and_main_param_groups = classmethod(_with_cuda_type_names(build_groups))
    clip = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = clip
    optimizer.clip_grad_by_total_norm_fp32 = clip  # imported by name there


def _patch_rng_state_setter() -> None:
    """megatron.core.tensor_parallel.random._set_cuda_rng_state / _get_cuda_rng_state (0.16.1).

    Both index ``torch.cuda.default_generators`` and defer through ``torch.cuda._lazy_call``.
    On CPU the tracker's states live in the CPU default generator, so get/set it directly.
    """
    from megatron.core.tensor_parallel import random

    def _get_cpu_rng_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def _set_cpu_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    random._get_cuda_rng_state = _get_cpu_rng_state
    random._set_cuda_rng_state = _set_cpu_rng_state


def _patch_rng_tracker_fork() -> None:
    """megatron.core.tensor_parallel.random.CudaRNGStatesTracker.fork (0.16.1).

    fork() swaps the tracked "CUDA" generator state in and out, and warns when the CPU RNG
    state changed inside. On CPU the tracked generator *is* the CPU generator, so that
    warning fires on every dropout/init under TP; this copy of fork() drops only that check.
    """
    from megatron.core.tensor_parallel import random

    @contextlib.contextmanager
    def fork(self, name=random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        orig_state = random._get_cuda_rng_state()
        orig_state_name = self._current_state_name
        if orig_state_name != "default-rng":
            self.states_[orig_state_name] = orig_state
        random._set_cuda_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = random._get_cuda_rng_state()
            if orig_state_name != "default-rng":
                orig_state = self.states_[orig_state_name]
            random._set_cuda_rng_state(orig_state)
            self._current_state_name = orig_state_name

    random.CudaRNGStatesTracker.fork = fork


def _patch_moe_te_general_gemm() -> None:
    """megatron.core.transformer.moe.moe_utils.te_general_gemm (0.16.1).

    The name is bound only when Transformer Engine imports, yet RouterGatingLinearFunction
    tests ``te_general_gemm is not None``: without TE that is a NameError. Bind it to None
    so the router falls back to torch matmuls.
    """
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _patch_moe_split_sizes_to_host() -> None:
    """megatron.core.transformer.moe.moe_utils.maybe_move_tensor_to_cpu (0.16.1).

    The alltoall dispatcher moves its split sizes "to the host as numpy" through this helper,
    which converts only CUDA tensors; on CPU the splits stay tensors and
    ``all_to_all_single`` rejects them. Convert CPU tensors too when numpy is asked for.
    """
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.cpu().numpy()
        return tensor.cpu() if torch.is_tensor(tensor) else tensor

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu  # imported by name


def _patch_torch_norm_sequence_parallel() -> None:
    """megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__ (0.16.1).

    The local spec's torch LayerNorm/RMSNorm asserts ``not config.sequence_parallel`` because
    it does not tag its parameters: under SP each TP rank sees only its sequence shard, so the
    norm grads must be summed over TP, which finalize_model_grads does for parameters marked
    ``sequence_parallel = True`` (as FusedLayerNorm and TE norms mark them). Build the norm
    with SP switched off in the check and mark its parameters instead.
    """
    from megatron.core.transformer import torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, *args, **kwargs)
        config_without_sp = copy.copy(config)
        config_without_sp.sequence_parallel = False
        norm = original_new(cls, config_without_sp, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = __new__


class _DeferredSend:
    """A pipeline send as megatron waits on it after ``_patch_pipeline_p2p``: already done."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


# Gloo tags of the two directions between pipeline neighbours: activations (and their shapes) go
# send_next -> recv_prev, gradients send_prev -> recv_next. With PP=2 prev and next are one peer.
_P2P_FORWARD_TAG, _P2P_BACKWARD_TAG = 1, 2


def _patch_pipeline_p2p() -> None:
    """megatron.core.pipeline_parallel.p2p_communication._batched_p2p_ops and
    P2PCommunicator._communicate_shapes (0.16.1): the interleaved (virtual pipeline) schedule on gloo.

    Two things go wrong on gloo, both with PP=2, where the previous and the next stage are one rank:

    * They ``wait()`` on every request, sends included. On NCCL that only orders the stream; on gloo
      it blocks the CPU until the peer has posted the matching receive (even for 24 bytes). In the
      interleaved schedule the last stage sends a gradient shape and waits on it before it posts
      the receive for the activation the first stage is sending, while the first stage waits on
      that activation send before it reaches its receives (cool-down): a deadlock. Here sends are
      handed back already "done" and their real requests waited when the schedule returns, by
      which time the peer has posted every receive; receives are waited as before.
    * Both directions use tag 0 in one process group, and a call posts send_prev before send_next
      but recv_prev before recv_next; gloo pairs a peer's messages of one tag in posting order. With
      one peer on both sides a gradient can land in an activation's receive (a shape mismatch
      with variable sequence lengths). Each direction gets its own tag here, so messages pair up in
      schedule order per direction. (megatron's unbatched ``_p2p_ops`` keeps the directions apart
      for 2-rank groups with a second process group; the batched path and the shapes do not.)

    The rest of ``_communicate`` (buffers, which calls send what) is megatron's. Only the batched
    path (``batch_p2p_comm``, megatron's default, ours) is replaced.
    """
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    pending_sends = []  # (request, storage): the storage stays alive until the send is waited

    def batched_p2p_ops(
        *,
        tensor_send_prev,
        tensor_recv_prev,
        tensor_send_next,
        tensor_recv_next,
        group,
        prev_pipeline_rank,
        next_pipeline_rank,
    ):
        dist, requests = torch.distributed, []
        for op, tensor, peer, tag in (  # megatron's order
            (dist.isend, tensor_send_prev, prev_pipeline_rank, _P2P_BACKWARD_TAG),
            (dist.irecv, tensor_recv_prev, prev_pipeline_rank, _P2P_FORWARD_TAG),
            (dist.isend, tensor_send_next, next_pipeline_rank, _P2P_FORWARD_TAG),
            (dist.irecv, tensor_recv_next, next_pipeline_rank, _P2P_BACKWARD_TAG),
        ):
            if tensor is None:
                continue
            request = op(tensor, peer, group=group, tag=tag)
            if op is dist.isend:
                pending_sends.append((request, tensor.untyped_storage()))
                request = _DeferredSend()
            requests.append(request)
        return requests

    def communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        def shape_of(tensor):
            return None if tensor is None else torch.tensor(tensor.size(), dtype=torch.int64)

        recv_prev_shape = torch.empty(3, dtype=torch.int64) if recv_prev else None
        recv_next_shape = torch.empty(3, dtype=torch.int64) if recv_next else None
        for request in batched_p2p_ops(
            tensor_send_prev=shape_of(tensor_send_prev),
            tensor_recv_prev=recv_prev_shape,
            tensor_send_next=shape_of(tensor_send_next),
            tensor_recv_next=recv_next_shape,
            group=self.pp_group,
            prev_pipeline_rank=self.prev_rank,
            next_pipeline_rank=self.next_rank,
        ):
            request.wait()
        received = (recv_prev_shape, recv_next_shape)
        return tuple([0, 0, 0] if shape is None else shape.tolist() for shape in received)

    def waiting_for_sends(schedule):
        @functools.wraps(schedule)
        def run(*args, **kwargs):
            result = schedule(*args, **kwargs)
            while pending_sends:
                pending_sends.pop(0)[0].wait()
            return result

        return run

    p2p_communication._batched_p2p_ops = batched_p2p_ops
    p2p_communication.P2PCommunicator._communicate_shapes = communicate_shapes
    for name in ("forward_backward_pipelining_with_interleaving", "forward_backward_pipelining_without_interleaving"):
        setattr(schedules, name, waiting_for_sends(getattr(schedules, name)))


_FUNCTION_PATCHES = (
    _patch_param_type_checks,
    _patch_rng_state_setter,
    _patch_rng_tracker_fork,
    _patch_moe_te_general_gemm,
    _patch_moe_split_sizes_to_host,
    _patch_torch_norm_sequence_parallel,
    _patch_pipeline_p2p,
)
