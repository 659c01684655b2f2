"""The DiT block on megatron-core modules: modulate, attend, gate.

    x = x + gate_msa * SelfAttn(modulate(norm1(x), shift_msa, scale_msa))
    x = x + CrossAttn(norm2(x), text)                        # text-conditioned variants only
    x = x + gate_mlp * MLP(modulate(norm3(x), shift_mlp, scale_mlp))

The modulation stays one row per sample (``AdaLNRows``); tokens take their sample's row inside the
norm-modulate and gated-residual ops, which keep neither per-token rows nor the normed input.

ST-DiT replaces the self-attention line with a spatial (per-frame) and a temporal (per-position)
one, each modulated and gated on its own.

Attention, MLP (dense or MoE), norms and modulation come from a ``ModuleSpec`` (local or
Transformer Engine), so DiT, MovieGen-style Llama blocks and ST-DiT share this code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from torch import Tensor, nn

from dfm.models.common.adaln import AdaLNNorm, AdaLNRMSNorm
from dfm.models.common.factorized_layout import FactorizedAttentionParams
from dfm.models.common.fused import block_ops
from dfm.models.common.init import zero_init
from dfm.models.common.norm_recompute import norm_recomputed
from dfm.models.common.pack_inputs import PackInputs
from dfm.models.common.row_modulation import ModulationRows


@dataclass
class DiTLayerSubmodules:
    adaln: ModuleSpec | type
    self_attention: ModuleSpec | type
    mlp: ModuleSpec | type
    cross_attention: ModuleSpec | type | None = None
    temporal_attention: ModuleSpec | type | None = None  # ST-DiT only
    norm: type = AdaLNNorm  # affine-free: LayerNorm (DiT) or RMSNorm (Llama-style)


def block_norm(config, default: type) -> type:
    """The affine-free norm of a block: RMSNorm when the config asks for it, else the spec's."""
    return AdaLNRMSNorm if config.normalization == "RMSNorm" else default


@dataclass(frozen=True)
class FromWidth:
    """A linear whose input is ``width`` wide whatever its caller asks: megatron's cross-attention
    sizes its key / value projection from the hidden size, a narrower text context (NeMo's DiT-7B:
    1024) needs the context's width."""

    linear: type
    width: int

    def __call__(self, input_size: int, output_size: int, **kwargs):
        return self.linear(self.width, output_size, **kwargs)


def context_width_spec(spec: ModuleSpec, width: int, hidden: int) -> ModuleSpec:
    """``spec`` (a cross-attention) with its key / value projection reading ``width``-wide context."""
    if width == hidden:
        return spec
    submodules = dataclasses.replace(spec.submodules, linear_kv=FromWidth(spec.submodules.linear_kv, width))
    return dataclasses.replace(spec, submodules=submodules)


class DiTLayer(MegatronModule):
    """One DiT block. hidden [s, b, h] -> [s, b, h]."""

    num_modulations = 6

    def __init__(self, config, submodules: DiTLayerSubmodules, layer_number: int = 1):
        super().__init__(config=config)
        self.layer_number = layer_number
        norm, h, eps = block_norm(config, submodules.norm), config.hidden_size, config.layernorm_epsilon
        self.adaln = build_module(submodules.adaln, config=config, num_chunks=self.num_modulations)
        self.norm1 = norm(h, eps)
        self.self_attention = build_module(submodules.self_attention, config=config, layer_number=layer_number)
        self.cross_attention = None
        if submodules.cross_attention is not None:
            self.norm2 = norm(h, eps)
            cross_spec = context_width_spec(submodules.cross_attention, getattr(config, "cross_attention_dim", h), h)
            self.cross_attention = build_module(cross_spec, config=config, layer_number=layer_number)
            # Zero output (PixArt): a fresh block ignores the text until it learns to read it.
            zero_init(self.cross_attention.linear_proj)
        self.norm3 = norm(h, eps)
        # A dense MLP is sized by the config's ffn; an MoE layer sizes its experts itself.
        mlp_size = (
            {"layer_number": layer_number} if config.num_moe_experts else {"ffn_hidden_size": config.ffn_hidden_size}
        )
        self.mlp = build_module(submodules.mlp, config=config, **mlp_size)
        self.ops = block_ops(getattr(config, "compile_regions", False))

    def forward(self, hidden: Tensor, inputs: PackInputs) -> Tensor:
        """hidden [s, b, h] -> [s, b, h]; ``inputs`` holds this pack's conditioning and segments."""
        *attn_mod, shift_mlp, scale_mlp, gate_mlp = self.adaln(
            inputs.cond, inputs.token_sample_ids, inputs.tokens_per_sample
        )
        hidden = self.self_attend(hidden, attn_mod, inputs.rotary_pos_emb, inputs.self_attention)
        hidden = self.cross_attend(hidden, inputs.context, inputs.cross_attention)
        return self.feed_forward(hidden, shift_mlp, scale_mlp, gate_mlp, inputs.padding_mask)

    def self_attend(
        self, hidden: Tensor, modulation: list[ModulationRows], rotary_pos_emb, params: PackedSeqParams
    ) -> Tensor:
        """modulation: (shift, scale, gate), per-sample rows."""
        return self.attend(self.self_attention, self.norm1, hidden, modulation, rotary_pos_emb, params)

    def attend(self, attention, norm, hidden: Tensor, modulation, rotary_pos_emb, params) -> Tensor:
        """Gated residual self-attention; modulation: (shift, scale, gate) per-sample rows (the segments'
        token order is the attention's business)."""
        shift, scale, gate = modulation
        attn_in = self.norm_modulate(norm, hidden, shift, scale)
        out, bias = attention(attn_in, attention_mask=None, rotary_pos_emb=rotary_pos_emb, packed_seq_params=params)
        return self.gated_residual(hidden, gate, out, bias)

    def norm_modulate(self, norm: nn.Module, hidden: Tensor, shift: ModulationRows, scale: ModulationRows) -> Tensor:
        """modulate(norm(hidden), shift, scale) [s, b, h] in one fused region (tensors and plain numbers only
        cross into it); neither the normed tensor nor a per-token modulation is kept for backward."""
        rms = isinstance(norm, nn.RMSNorm)
        return self.ops.norm_modulate_rows(hidden, shift.rows, scale.rows, shift.ids, norm.eps, rms, shift.per_row)

    def gated_residual(self, hidden: Tensor, gate: ModulationRows, out: Tensor, bias: Tensor | None) -> Tensor:
        """hidden + gate * (out + bias) [s, b, h], each token taking its sample's gate row."""
        return self.ops.gated_residual_rows(hidden, gate.rows, gate.ids, out, bias, gate.per_row)

    def cross_attend(self, hidden: Tensor, context: Tensor | None, params: PackedSeqParams | None) -> Tensor:
        if self.cross_attention is None:
            return hidden
        out, bias = self.cross_attention(
            self.cross_norm(hidden), attention_mask=None, key_value_states=context, packed_seq_params=params
        )
        return self.ops.residual(hidden, out, bias)

    def cross_norm(self, hidden: Tensor) -> Tensor:
        """norm2(hidden): an affine-free norm keeps only its input and statistics (``norm_recomputed``);
        an affine one (Wan's) runs as its module."""
        if isinstance(self.norm2, (AdaLNNorm, AdaLNRMSNorm)):
            return norm_recomputed(hidden, self.norm2.eps, isinstance(self.norm2, nn.RMSNorm))
        return self.norm2(hidden)

    def feed_forward(
        self, hidden: Tensor, shift: ModulationRows, scale: ModulationRows, gate: ModulationRows, padding_mask=None
    ) -> Tensor:
        """hidden [s, b, h] + gate * MLP(modulate(norm3(hidden), shift, scale)); padding_mask [s] or None."""
        # megatron's MoE layer takes the mask as [b, s] (a dense MLP ignores it).
        mask = {} if padding_mask is None else {"padding_mask": padding_mask[None]}
        out, bias = self.mlp(self.norm_modulate(self.norm3, hidden, shift, scale), **mask)
        return self.gated_residual(hidden, gate, out, bias)


class STDiTLayer(DiTLayer):
    """ST-DiT block: spatial self-attention within each frame, then temporal self-attention at
    each (h, w) position, each with its own adaLN shift / scale / gate; then cross-attention, MLP."""

    num_modulations = 9

    def __init__(self, config, submodules: DiTLayerSubmodules, layer_number: int = 1):
        super().__init__(config, submodules, layer_number)
        self.norm_temporal = submodules.norm(config.hidden_size, config.layernorm_epsilon)
        self.temporal_attention = build_module(submodules.temporal_attention, config=config, layer_number=layer_number)

    def self_attend(
        self, hidden: Tensor, modulation: list[ModulationRows], rotary_pos_emb, params: FactorizedAttentionParams
    ) -> Tensor:
        """Spatial then temporal attention; modulation: (shift, scale, gate) of each, per-sample rows."""
        hidden = self.attend(self.self_attention, self.norm1, hidden, modulation[0:3], rotary_pos_emb, params.spatial)
        return self.attend(
            self.temporal_attention, self.norm_temporal, hidden, modulation[3:6], rotary_pos_emb, params.temporal
        )
