"""The plain-PyTorch DiT a researcher would write: the tight reference the benchmarks measure dfm against.

Same shapes as dfm's DiT family (patch embed, adaLN-Zero, self-attn [+ cross-attn] + MLP blocks, final
adaLN layer) written the way facebookresearch/DiT writes it: ``nn.Linear``, fused QKV, dense batched
``[B, L, h]`` tensors, one ``F.scaled_dot_product_attention`` call per attention, no megatron-core.
The block follows the config where dfm's does: LayerNorm or RMSNorm, GELU or SwiGLU (``moviegen``),
linear biases, per-head q/k RMSNorm, RoPE (cos / sin made once a forward) or sincos positions.

Packs: the reference cannot attend within a pack, so ``batches_from_pack`` regroups a pack's samples
into dense batches of one latent shape (text padded to the group's longest caption, masked in
cross-attention). The runners do this before the timed window, as a researcher's loader hands over
ready batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dfm.data.packed_batch import PackedBatch, segment_lengths
from dfm.models.common.embeddings import rope_3d_freqs, sincos_3d


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE. x [B, heads, L, d], cos / sin [L, d]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


@dataclass(frozen=True)
class BlockShape:
    hidden: int
    heads: int
    ffn: int
    cross: bool
    rms: bool  # RMSNorm (else LayerNorm), affine-free in the adaLN norms
    gated: bool  # SwiGLU MLP (else tanh-GELU)
    bias: bool
    qk_norm: bool


def affine_free_norm(shape: BlockShape) -> nn.Module:
    if shape.rms:
        return nn.RMSNorm(shape.hidden, eps=1e-6, elementwise_affine=False)
    return nn.LayerNorm(shape.hidden, elementwise_affine=False, eps=1e-6)


class Attention(nn.Module):
    """Self-attention (fused QKV), or cross-attention when ``forward`` gets ``context``."""

    def __init__(self, shape: BlockShape, cross: bool):
        super().__init__()
        h, self.heads = shape.hidden, shape.heads
        if cross:
            self.q = nn.Linear(h, h, bias=shape.bias)
            self.kv = nn.Linear(h, 2 * h, bias=shape.bias)
        else:
            self.qkv = nn.Linear(h, 3 * h, bias=shape.bias)
        self.proj = nn.Linear(h, h, bias=shape.bias)
        head_dim = h // shape.heads
        qk_norm = shape.qk_norm and not cross
        self.q_norm = nn.RMSNorm(head_dim, eps=1e-6) if qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(head_dim, eps=1e-6) if qk_norm else nn.Identity()

    def forward(self, x: Tensor, rope=None, context=None, context_mask=None) -> Tensor:
        b, n, h = x.shape
        if context is None:
            q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            q, k = self.q_norm(q), self.k_norm(k)
            if rope is not None:
                q, k = rotate(q, *rope), rotate(k, *rope)
        else:
            q = self.q(x).view(b, n, self.heads, -1).transpose(1, 2)
            k, v = self.kv(context).view(b, context.shape[1], 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=context_mask)
        return self.proj(out.transpose(1, 2).reshape(b, n, h))


class MLP(nn.Module):
    def __init__(self, shape: BlockShape):
        super().__init__()
        self.gated = shape.gated
        self.fc1 = nn.Linear(shape.hidden, (2 if shape.gated else 1) * shape.ffn, bias=shape.bias)
        self.fc2 = nn.Linear(shape.ffn, shape.hidden, bias=shape.bias)

    def forward(self, x: Tensor) -> Tensor:
        y = self.fc1(x)
        if self.gated:
            y1, y2 = y.chunk(2, dim=-1)
            return self.fc2(F.silu(y1) * y2)
        return self.fc2(F.gelu(y, approximate="tanh"))


class Block(nn.Module):
    def __init__(self, shape: BlockShape):
        super().__init__()
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(shape.hidden, 6 * shape.hidden))
        self.norm1 = affine_free_norm(shape)
        self.attn = Attention(shape, cross=False)
        self.cross_attn = Attention(shape, cross=True) if shape.cross else None
        self.norm2 = affine_free_norm(shape) if shape.cross else None
        self.norm3 = affine_free_norm(shape)
        self.mlp = MLP(shape)

    def forward(self, x, c, rope, context, context_mask):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa), rope)
        if self.cross_attn is not None:
            x = x + self.cross_attn(self.norm2(x), context=context, context_mask=context_mask)
        return x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm3(x), shift_mlp, scale_mlp))


def block_shape(model_cfg) -> BlockShape:
    moviegen = model_cfg.architecture == "moviegen"
    return BlockShape(
        hidden=model_cfg.hidden_size,
        heads=model_cfg.num_attention_heads,
        ffn=model_cfg.effective_ffn_hidden_size,
        cross=model_cfg.architecture != "dit_adaln",
        rms=moviegen or model_cfg.normalization == "rmsnorm",
        gated=moviegen,
        bias=model_cfg.add_bias_linear and not moviegen,
        qk_norm=model_cfg.qk_layernorm,
    )


class ReferenceDiT(nn.Module):
    """(x [B, L, patch_dim], c_noise [B], pos_ids [L, 3], text [B, Lt, D]) -> [B, L, patch_dim]."""

    def __init__(self, model_cfg):
        super().__init__()
        shape = block_shape(model_cfg)
        h, self.heads, self.cross = shape.hidden, shape.heads, shape.cross
        patch_dim = model_cfg.in_channels * model_cfg.patch_temporal * model_cfg.patch_spatial**2
        self.pos_embedding = model_cfg.pos_embedding
        self.x_embedder = nn.Linear(patch_dim, h)
        self.t_embedder = nn.Sequential(nn.Linear(256, h), nn.SiLU(), nn.Linear(h, h))
        if self.cross:
            self.y_embedder = nn.Sequential(
                nn.Linear(model_cfg.text_embed_dim, h), nn.GELU(approximate="tanh"), nn.Linear(h, h)
            )
        self.blocks = nn.ModuleList(Block(shape) for _ in range(model_cfg.num_layers))
        self.final_norm = affine_free_norm(shape)
        self.final_adaLN = nn.Sequential(nn.SiLU(), nn.Linear(h, 2 * h))
        self.final_linear = nn.Linear(h, patch_dim)

    def timestep_embedding(self, c_noise: Tensor, dim: int = 256) -> Tensor:
        half = dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=c_noise.device) / half)
        args = c_noise.float()[:, None] * freqs[None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)

    def forward(self, x, c_noise, pos_ids, text=None, text_mask=None):
        x = self.x_embedder(x)
        rope = None
        if self.pos_embedding == "rope3d":
            angles = rope_3d_freqs(pos_ids, x.shape[-1] // self.heads)[:, 0, 0]
            rope = (angles.cos().to(x.dtype), angles.sin().to(x.dtype))
        elif self.pos_embedding == "sincos3d":
            x = x + sincos_3d(pos_ids, x.shape[-1]).to(x.dtype)
        c = self.t_embedder(self.timestep_embedding(c_noise).to(x.dtype))  # a bf16 model stays bf16
        context = self.y_embedder(text) if self.cross else None
        for block in self.blocks:
            x = block(x, c, rope, context, text_mask)
        shift, scale = self.final_adaLN(c).chunk(2, dim=1)
        return self.final_linear(modulate(self.final_norm(x), shift, scale))


@dataclass
class ShapeBatch:
    """Samples of one latent shape from a pack, stacked."""

    latents: Tensor  # [B, L, patch_dim]
    pos_ids: Tensor  # [L, 3]
    text: Tensor  # [B, Lt, D], zero-padded
    text_mask: Tensor | None  # [B, 1, 1, Lt] bool (True = attend), None when no padding

    def to(self, device) -> ShapeBatch:
        mask = None if self.text_mask is None else self.text_mask.to(device, non_blocking=True)
        return ShapeBatch(*(t.to(device, non_blocking=True) for t in (self.latents, self.pos_ids, self.text)), mask)


def gather_rows(source: Tensor, starts: Tensor, length: int) -> Tensor:
    """source [S, D], starts [B] -> [B, length, D]: rows starts[i] .. starts[i] + length - 1."""
    return source[starts[:, None] + torch.arange(length)]


def padded_text(pack: PackedBatch, members: Tensor) -> tuple[Tensor, Tensor | None]:
    """Captions of ``members`` zero-padded to the longest -> ([B, Lt, D], mask [B, 1, 1, Lt] or None)."""
    starts = pack.cu_seqlens_kv_padded[:-1].long()[members]
    lengths = segment_lengths(pack.cu_seqlens_kv).long()[members]
    longest = int(lengths.max())
    mask = torch.arange(longest)[None] < lengths[:, None]
    rows = torch.where(mask, starts[:, None] + torch.arange(longest), 0)
    text = pack.context[rows] * mask[..., None]
    return text, None if bool(mask.all()) else mask[:, None, None]


def batches_from_pack(pack: PackedBatch) -> list[ShapeBatch]:
    """Regroup a (CPU) pack's samples by latent shape into dense batches."""
    shapes, group_of = pack.latent_shape.unique(dim=0, return_inverse=True)
    starts = pack.cu_seqlens_q_padded[:-1].long()
    lengths = segment_lengths(pack.cu_seqlens_q).long()
    batches = []
    for group in range(len(shapes)):
        members = (group_of == group).nonzero()[:, 0]
        length = int(lengths[members[0]])
        text, mask = padded_text(pack, members)
        first = int(starts[members[0]])
        pos_ids = pack.pos_ids[first : first + length]
        batches.append(ShapeBatch(gather_rows(pack.latents, starts[members], length), pos_ids, text, mask))
    return batches
