"""What every block of a pack reads besides the hidden states, built once per pack."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

from dfm.models.attention.rope_tables import RotaryTables
from dfm.models.common.factorized_layout import FactorizedAttentionParams
from dfm.models.common.row_modulation import RowLayout


@dataclass
class PackInputs:
    """Per-pack block inputs for this rank's share of the tokens.

    N: samples in the pack; s: this context-parallel rank's tokens; s_sp: their share held by
    this TP rank under sequence parallelism (s without it); s_kv: the pack's text tokens.
    """

    cond: Tensor  # [N, h] per-sample conditioning (timestep, class)
    token_sample_ids: Tensor  # [s_sp] long, the sample of each token
    self_attention: PackedSeqParams | FactorizedAttentionParams  # factorized: ST-DiT
    cross_attention: PackedSeqParams | None = None  # None: no text conditioning (dit_adaln)
    context: Tensor | None = None  # [s_kv (/ tp under SP), 1, h] embedded text
    # [s, 1, 1, d] (attention sees all s) RoPE angles, rope3d only; DiT: wrapped in RotaryTables
    rotary_pos_emb: Tensor | RotaryTables | None = None
    padding_mask: Tensor | None = None  # [s_sp] bool, True on padding (MoE routing statistics leave it out)
    # How the s_sp tokens lie by sample (row_modulation.RowLayout): L for N runs of L tokens in sample
    # order (one sample shape, no split), (rows, L) runs for a pack grouped by length: the row ops
    # broadcast rows over [n, L, b, h] instead of gathering them; else 0.
    tokens_per_sample: RowLayout = 0
