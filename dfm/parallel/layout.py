"""ParallelLayout: how a run's ranks split the model (TP, PP, VPP, CP, EP, SP) and the data (DP).

Built once from the config and the launched world (`ParallelLayout.from_config`). The sizes are
named in the config (dfm/config/container.py) and here only; every other module asks the layout:
megatron's keyword arguments, the padding a pack needs, this rank's share of a pack, the
checkpoint fingerprint. An invalid layout cannot be built (rules.py); `check_model` adds the
rules a model and its data must meet under the layout. Megatron and the model's CP code are
imported inside the methods that run under process groups: the config phase needs neither.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dfm.parallel import rules

if TYPE_CHECKING:
    from torch import Tensor, device

    from dfm.data.packed_batch import PackedBatch
    from dfm.parallel.sequence_split import SequenceSplit

# Short name -> ModelConfig field. The sizes' fields are also megatron's keyword names.
CONFIG_FIELDS = {
    "tp": "tensor_model_parallel_size",
    "pp": "pipeline_model_parallel_size",
    "vpp": "virtual_pipeline_model_parallel_size",
    "cp": "context_parallel_size",
    "ep": "expert_model_parallel_size",
    "sp": "sequence_parallel",
}
SIZES = ("tp", "pp", "vpp", "cp", "ep")


def launched_world_size() -> int:
    """Ranks torchrun started (WORLD_SIZE); 1 for a process started without it."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass(frozen=True)
class ParallelLayout:
    """world_size = dp x cp x pp x tp ranks; vpp model chunks per pipeline stage (None: one);
    experts sharded over ep of each stage's dp x cp ranks; sp: the sequence split over the tp
    ranks between blocks."""

    world_size: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    vpp: int | None = None
    sp: bool = False
    dp: int = field(init=False)

    def __post_init__(self) -> None:
        rules.check_sizes(self)
        object.__setattr__(self, "dp", self.world_size // self.model_parallel)
        rules.check_world(self)

    @classmethod
    def from_config(cls, model: Any, world_size: int | None) -> ParallelLayout:
        """The layout of ``model``'s sizes (its ``CONFIG_FIELDS`` attributes: the config's ModelConfig)
        on ``world_size`` ranks. None (a config read outside a launch): the smallest world the sizes
        tile, so only the world's own rules cannot fail."""
        values = {name: getattr(model, CONFIG_FIELDS[name]) for name in CONFIG_FIELDS}
        if world_size is None:
            world_size = _smallest_world(values)
        return cls(world_size=world_size, **values)

    @staticmethod
    def key(name: str) -> str:
        """'tp' -> 'model.tensor_model_parallel_size': the key an error tells the user to change."""
        return f"model.{CONFIG_FIELDS[name]}"

    @property
    def model_parallel(self) -> int:
        """Ranks of one model replica: tp x pp x cp."""
        return self.tp * self.pp * self.cp

    @property
    def chunks_per_stage(self) -> int:
        """Model chunks each pipeline stage builds (vpp, or 1 without virtual pipelining)."""
        return self.vpp or 1

    @property
    def pipeline_stages(self) -> int:
        """(Virtual) pipeline stages the layers are divided among: pp x vpp."""
        return self.pp * self.chunks_per_stage

    def config_values(self) -> dict[str, Any]:
        """The ModelConfig fields of this layout (``dataclasses.replace(model, **values)``)."""
        return {CONFIG_FIELDS[name]: getattr(self, name) for name in CONFIG_FIELDS}

    def megatron_parallel_kwargs(self) -> dict[str, int | None]:
        """The sizes as megatron names them: for TransformerConfig and
        ``parallel_state.initialize_model_parallel`` (sp is TransformerConfig's ``sequence_parallel``)."""
        return {CONFIG_FIELDS[name]: getattr(self, name) for name in SIZES}

    def check_model(self, model: rules.Model, seq_length: int) -> None:
        """ConfigError naming the key to change if ``model`` (packs of ``seq_length`` tokens)
        cannot run under this layout."""
        rules.check_model(self, model, seq_length)

    def padding_multiples(self) -> tuple[int, int]:
        """(segment, total): every sample's segment is padded to a multiple of ``segment`` (2 x cp
        chunks for the CP split), the pack to a multiple of ``total`` (its CP share split over
        the TP ranks under SP)."""
        segment = 2 * self.cp if self.cp > 1 else 1
        return segment, (self.tp if self.sp else 1) * segment

    def fingerprint(self) -> dict[str, int]:
        """What a checkpoint records of the layout: per-rank state (RNG) restores only into an
        equal one, the data position into the same dp."""
        return {
            "world": self.world_size,
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.dp,
            "cp": self.cp,
            "ep": self.ep,
            "vpp": self.chunks_per_stage,
        }

    def pack_split(self, batch: PackedBatch) -> SequenceSplit:
        """This CP rank's share of ``batch``, built from its host offsets (no device sync)."""
        return self.sequence_split(batch.host_view().cu_seqlens_q_padded, batch.latents.device)

    def sequence_split(self, cu_seqlens_padded: Tensor, device: device | None = None) -> SequenceSplit:
        """This CP rank's share of a pack with segment offsets ``cu_seqlens_padded [N+1]``."""
        from dfm.parallel.sequence_split import SequenceSplit, split_for_rank

        if self.cp == 1:
            return SequenceSplit(size=1)
        from megatron.core import parallel_state

        rank, group = parallel_state.get_context_parallel_rank(), parallel_state.get_context_parallel_group()
        return split_for_rank(cu_seqlens_padded, self.cp, rank, group, device)

    def sequence_parallel_slice(self, per_token: Tensor) -> Tensor:
        """[S, ...] -> this TP rank's contiguous [S/tp, ...] under sequence parallelism; else as is."""
        if not self.sp:
            return per_token
        from megatron.core import parallel_state

        return per_token.chunk(self.tp)[parallel_state.get_tensor_model_parallel_rank()]


def layout_of(transformer_config) -> ParallelLayout:
    """The layout a model was built for (the ``parallel_layout`` field of its DfmTransformerConfig)."""
    layout = getattr(transformer_config, "parallel_layout", None)
    if layout is None:
        raise ValueError(
            "this TransformerConfig carries no ParallelLayout: build it with "
            "dfm.models.common.transformer_config.build_transformer_config"
        )
    return layout


def _smallest_world(values: dict[str, Any]) -> int:
    """tp x pp x cp ranks, times the fewest data-parallel replicas that let ep divide dp x cp."""
    tp, pp, cp, ep = (values[name] for name in ("tp", "pp", "cp", "ep"))
    if min(tp, pp, cp, ep) < 1:
        return 1  # the size rules refuse these sizes, naming the key
    return tp * pp * cp * (ep // math.gcd(ep, cp))
