"""The megatron modules of each attention backend: the linears and the core attention a layer spec
is built from. Local backends (sdpa, flex, varlen) use megatron-core's parallel linears (one F.linear
on one rank: one_rank_linear.py) and
``PackedDotProductAttention``; ``te`` Transformer Engine's, imported only when asked for.

Parameter names are the same in both, so a checkpoint moves between them.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.transformer.spec_utils import ModuleSpec

from dfm.models.attention.core import PackedDotProductAttention
from dfm.models.common.one_rank_linear import LocalColumnLinear, LocalRowLinear


@dataclass(frozen=True)
class BackendModules:
    column_linear: type
    row_linear: type
    core_attention: ModuleSpec
    use_te: bool


def local_modules(attention_backend: str = "sdpa") -> BackendModules:
    core = ModuleSpec(module=PackedDotProductAttention, params={"backend": attention_backend})
    return BackendModules(LocalColumnLinear, LocalRowLinear, core, use_te=False)


def te_modules() -> BackendModules:
    """Transformer Engine modules; raises ImportError when TE is not installed."""
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TERowParallelLinear

    from dfm.models.attention.te import TEPackedDotProductAttention

    return BackendModules(
        TEColumnParallelLinear, TERowParallelLinear, ModuleSpec(module=TEPackedDotProductAttention), True
    )


def backend_modules(backend: str) -> BackendModules:
    """The modules of a resolved backend name (``dfm.models.build.resolve_attention_backend``)."""
    return te_modules() if backend == "te" else local_modules(backend)
