"""FLUX blocks on megatron-core modules. hidden [s_text + s_image, b, h]: the text stream's tokens
then the image stream's (each this rank's share), split apart inside the block.

Double-stream (MMDiT) block: each stream has its own adaLN, q/k/v, per-head q/k RMSNorm, output
projection and MLP; attention is joint over each sample's [text, image] tokens.

    x = x + gate_msa * Proj(JointAttn(modulate(norm(x), shift_msa, scale_msa)))    (per stream)
    x = x + gate_mlp * MLP(modulate(norm(x), shift_mlp, scale_mlp))

Single-stream block: one set of weights for both streams; attention and MLP in parallel.

    y = modulate(norm(x), shift, scale)
    x = x + gate * proj_out(cat(JointAttn(y), gelu(proj_mlp(y))))

Kept for backward no more than needed (docs/performance.md "Activations per token"): the modulation
stays one row per sample and the normed input is recomputed (``norm_modulate_rows``,
``gated_residual_rows``); q / k norm and RoPE are one Function keeping the un-normed heads
(``qk_norm_rope``); the output projections keep the attention kernel's output, not their gathered
input, and ``proj_out`` keeps the activation output (or, under ``model.recompute_activation``, its
input) instead of the cat (common/rebuilt.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from torch import Tensor

from dfm.models.attention.qk_norm_rope import qk_norm_rope
from dfm.models.common.adaln import AdaLNModulation
from dfm.models.common.fused import block_ops
from dfm.models.common.rebuilt import through_rebuilt
from dfm.models.common.row_modulation import AdaLNRows, ModulationRows
from dfm.models.flux.joint_attention import QKV, JointAttentionPlan, joint_attention, stream_rows
from dfm.models.flux.strided import mark_strided, strided_sharded_state_dict


@dataclass
class FluxPackInputs:
    """Per-pack block inputs. s_text / s_image: this rank's text / image tokens (the SP share)."""

    cond: Tensor  # [N, h] timestep (+ guidance) + pooled text
    text_sample_ids: Tensor  # [s_text] long
    image_sample_ids: Tensor  # [s_image] long
    attention: JointAttentionPlan

    @property
    def num_text(self) -> int:
        return int(self.text_sample_ids.shape[0])


@dataclass
class FluxLayerSubmodules:
    column_linear: type
    row_linear: type
    core_attention: ModuleSpec
    qk_norm: type
    mlp: ModuleSpec | None = None  # double block only


def _parallel_linear(linear: type, config, sizes: tuple[int, int], init_method, **extra):
    """A megatron parallel linear with bias, not an expert's."""
    return build_module(linear, *sizes, config=config, init_method=init_method, bias=True, is_expert=False, **extra)


def column_linear(submodules: FluxLayerSubmodules, config, input_size: int, output_size: int, **extra):
    """A column-parallel linear with bias (output split over TP ranks)."""
    return _parallel_linear(
        submodules.column_linear,
        config,
        (input_size, output_size),
        config.init_method,
        gather_output=False,
        skip_bias_add=False,
        **extra,
    )


def row_linear(submodules: FluxLayerSubmodules, config, input_size: int, output_size: int):
    """A row-parallel linear whose bias is returned apart (added with the gate)."""
    sizes = (input_size, output_size)
    init = config.output_layer_init_method
    return _parallel_linear(submodules.row_linear, config, sizes, init, input_is_parallel=True, skip_bias_add=True)


class HeadProjection(MegatronModule):
    """x [s_sp, b, h], RoPE (cos, sin) [s, 1, 1, hn] fp32 or None -> this TP rank's q, k, v heads over
    the whole (CP-local) sequence, q and k RMS-normalised per head then rotated. ``linear_qkv`` rows
    are megatron's fused layout: per head [q, k, v]."""

    def __init__(self, config, submodules: FluxLayerSubmodules):
        super().__init__(config=config)
        h, hn = config.hidden_size, config.kv_channels
        self.linear_qkv = column_linear(submodules, config, h, 3 * h)
        self.q_layernorm = build_module(submodules.qk_norm, hidden_size=hn, config=config, eps=config.layernorm_epsilon)
        self.k_layernorm = build_module(submodules.qk_norm, hidden_size=hn, config=config, eps=config.layernorm_epsilon)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor] | None) -> QKV:
        qkv, _ = self.linear_qkv(x)
        s, b, hn = qkv.shape[0], qkv.shape[1], self.config.kv_channels
        heads = qkv.view(s, b, -1, 3 * hn)
        # The norms keep q and k for backward: as a copy, so that the fused output (and the value in
        # it, which the joint attention copies into its keys' order) is freed: hn per head less.
        query, key = heads[..., : 2 * hn].contiguous().split(hn, dim=-1)
        value = heads[..., 2 * hn :]
        return QKV(self.norm_rope(query, self.q_layernorm, rope), self.norm_rope(key, self.k_layernorm, rope), value)

    @staticmethod
    def norm_rope(x: Tensor, norm, rope: tuple[Tensor, Tensor] | None) -> Tensor:
        """The per-head norm then RoPE (interleaved pairs, in fp32), keeping x and the per-head rstd only."""
        cos, sin = rope if rope is not None else (None, None)
        return qk_norm_rope(x, norm.weight, cos, sin, norm.eps, interleaved=True)


class _FluxLayer(MegatronModule):
    """What both blocks share: the (eager or compiled) elementwise ops, affine-free LayerNorm +
    modulation and the gated residual on per-sample modulation rows."""

    def __init__(self, config, layer_number: int):
        super().__init__(config=config)
        self.layer_number = layer_number
        self.ops = block_ops(getattr(config, "compile_regions", False))

    def norm_modulate(self, x: Tensor, shift: ModulationRows, scale: ModulationRows) -> Tensor:
        eps = self.config.layernorm_epsilon
        return self.ops.norm_modulate_rows(x, shift.rows, scale.rows, shift.ids, eps, False)

    def gated_residual(self, x: Tensor, gate: ModulationRows, out: Tensor, bias: Tensor | None) -> Tensor:
        return self.ops.gated_residual_rows(x, gate.rows, gate.ids, out, bias)


class FluxDoubleLayer(_FluxLayer):
    """MMDiT block; ``text_*`` modules serve the text stream, the others the image stream."""

    def __init__(self, config, submodules: FluxLayerSubmodules, layer_number: int = 1):
        super().__init__(config, layer_number)
        self.adaln = AdaLNRows(config, num_chunks=6)
        self.text_adaln = AdaLNRows(config, num_chunks=6)
        self.image_heads = HeadProjection(config, submodules)
        self.text_heads = HeadProjection(config, submodules)
        self.core_attention = build_module(submodules.core_attention, config=config, layer_number=layer_number)
        self.linear_proj = row_linear(submodules, config, config.hidden_size, config.hidden_size)
        self.text_linear_proj = row_linear(submodules, config, config.hidden_size, config.hidden_size)
        self.mlp = build_module(submodules.mlp, config=config, ffn_hidden_size=config.ffn_hidden_size)
        self.text_mlp = build_module(submodules.mlp, config=config, ffn_hidden_size=config.ffn_hidden_size)

    def forward(self, hidden: Tensor, inputs: FluxPackInputs) -> Tensor:
        text, image = hidden[: inputs.num_text], hidden[inputs.num_text :]
        text_mod = self.text_adaln(inputs.cond, inputs.text_sample_ids)
        image_mod = self.adaln(inputs.cond, inputs.image_sample_ids)
        plan = inputs.attention
        joint_out = joint_attention(
            self.core_attention,
            plan,
            self.text_heads(self.norm_modulate(text, *text_mod[0:2]), None),
            self.image_heads(self.norm_modulate(image, *image_mod[0:2]), plan.rope),
        )
        # Each projection keeps the kernel's output, not its gathered input (common/rebuilt.py).
        text_out = through_rebuilt(self.text_linear_proj, functools.partial(stream_rows, plan, True), joint_out)
        image_out = through_rebuilt(self.linear_proj, functools.partial(stream_rows, plan, False), joint_out)
        text = self.gated_residual(text, text_mod[2], *text_out)
        image = self.gated_residual(image, image_mod[2], *image_out)
        text = self.feed_forward(self.text_mlp, text, *text_mod[3:6])
        image = self.feed_forward(self.mlp, image, *image_mod[3:6])
        return torch.cat([text, image])

    def feed_forward(self, mlp, x: Tensor, shift: ModulationRows, scale: ModulationRows, gate: ModulationRows):
        """x [s, b, h] -> x + gate * MLP(modulate(norm(x))) (the MLP: ActivationMLP)."""
        return self.gated_residual(x, gate, *mlp(self.norm_modulate(x, shift, scale)))


class FluxSingleLayer(_FluxLayer):
    """Parallel attention + MLP block shared by both streams. ``proj_mlp`` is column-parallel with
    stride ``mlp_ratio`` and ``proj_out`` row-parallel with stride ``mlp_ratio + 1``, so each rank's
    [heads, MLP columns] input meets its own slice of proj_out's columns (see strided.py)."""

    def __init__(self, config, submodules: FluxLayerSubmodules, layer_number: int = 1):
        super().__init__(config, layer_number)
        h, ffn = config.hidden_size, config.ffn_hidden_size
        if ffn % h:
            raise ValueError(f"the single-stream FLUX block needs ffn_hidden_size ({ffn}) a multiple of hidden ({h})")
        ratio = ffn // h
        self.adaln = AdaLNModulation(config, num_chunks=3)  # rows only (``rows``): one set for both streams
        self.heads = HeadProjection(config, submodules)
        self.core_attention = build_module(submodules.core_attention, config=config, layer_number=layer_number)
        self.proj_mlp = column_linear(submodules, config, h, ffn, stride=ratio)
        self.proj_out = row_linear(submodules, config, h + ffn, h)
        mark_strided(self.proj_mlp.weight, 0, ratio)
        mark_strided(self.proj_out.weight, 1, ratio + 1)

    def forward(self, hidden: Tensor, inputs: FluxPackInputs) -> Tensor:
        plan = inputs.attention
        rows = self.adaln.rows(inputs.cond).chunk(3, dim=-1)  # shift, scale, gate [N, h], both streams'
        streams = [
            (hidden[: inputs.num_text], inputs.text_sample_ids, True),
            (hidden[inputs.num_text :], inputs.image_sample_ids, False),
        ]
        modulations = [[ModulationRows(r, ids) for r in rows] for _, ids, _ in streams]
        normed = [self.norm_modulate(x, shift, scale) for (x, *_), (shift, scale, _) in zip(streams, modulations)]
        joint_out = joint_attention(
            self.core_attention, plan, self.heads(normed[0], None), self.heads(normed[1], plan.rope)
        )
        outputs = []
        for (x, _, text), (_, _, gate), y in zip(streams, modulations, normed):
            mlp, _ = self.proj_mlp(y)
            out = self.project_out(functools.partial(stream_rows, plan, text), joint_out, mlp)
            outputs.append(self.gated_residual(x, gate, *out))
        return torch.cat(outputs)

    def project_out(self, attention_rows, joint_out: Tensor, mlp: Tensor) -> tuple[Tensor, Tensor | None]:
        """proj_out(cat(attention_rows(joint_out), act(mlp))) [s, b, h] (+ bias), keeping the joint output
        and act(mlp) (under ``model.recompute_activation``: mlp, which act's backward keeps anyway),
        not the cat."""
        act = self.config.activation_func
        if self.config.recompute_activation:
            source, branch = mlp, act
        else:
            source, branch = act(mlp), None

        def proj_in(joint: Tensor, source: Tensor) -> Tensor:
            return torch.cat([attention_rows(joint), source if branch is None else branch(source)], dim=-1)

        return through_rebuilt(self.proj_out, proj_in, joint_out, source)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        return strided_sharded_state_dict(self, state, prefix)
