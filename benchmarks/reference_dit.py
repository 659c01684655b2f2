"""The textbook DiT in plain PyTorch: the reference the benchmarks measure dfm against.

Same shapes as dfm's DiT (patch embed, adaLN-Zero, self-attn [+ cross-attn] + MLP blocks, final
adaLN layer) written the way facebookresearch/DiT writes it: ``nn.Linear``, ``nn.LayerNorm``,
``F.scaled_dot_product_attention``, batched ``[B, L, h]`` tensors, no megatron-core.

Packed mixed batches: the reference cannot attend within a pack, so ``batches_from_pack``
regroups a pack's samples into fixed-size batches of one latent shape each (text padded to
the group's longest caption, masked in cross-attention). A step runs every group forward and
backward (gradients accumulate), then one optimizer step: the same samples and tokens as dfm.
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


def rotate(x: Tensor, angles: Tensor) -> Tensor:
    """Rotate-half RoPE. x [B, heads, L, d], angles [L, d]."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * angles.cos().to(x.dtype) + rotated * angles.sin().to(x.dtype)


class Attention(nn.Module):
    """Self-attention, or cross-attention when ``forward`` gets ``context``."""

    def __init__(self, hidden: int, heads: int, cross: bool):
        super().__init__()
        self.heads = heads
        if cross:
            self.q = nn.Linear(hidden, hidden)
            self.kv = nn.Linear(hidden, 2 * hidden)
        else:
            self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def split_heads(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        return x.view(b, n, self.heads, -1).transpose(1, 2)

    def forward(self, x: Tensor, rope: Tensor | None = None, context=None, context_mask=None) -> Tensor:
        if context is None:
            q, k, v = (self.split_heads(t) for t in self.qkv(x).chunk(3, dim=-1))
            if rope is not None:
                q, k = rotate(q, rope), rotate(k, rope)
        else:
            q = self.split_heads(self.q(x))
            k, v = (self.split_heads(t) for t in self.kv(context).chunk(2, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=context_mask)
        return self.proj(out.transpose(1, 2).flatten(2))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, cross: bool):
        super().__init__()
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden))
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden, heads, cross=False)
        self.cross_attn = Attention(hidden, heads, cross=True) if cross else None
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6) if cross else None
        self.norm3 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(hidden, 4 * hidden), nn.GELU(approximate="tanh"), nn.Linear(4 * hidden, hidden)
        )

    def forward(self, x, c, rope, context, context_mask):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa), rope)
        if self.cross_attn is not None:
            x = x + self.cross_attn(self.norm2(x), context=context, context_mask=context_mask)
        return x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm3(x), shift_mlp, scale_mlp))


class ReferenceDiT(nn.Module):
    """(x [B, L, patch_dim], c_noise [B], pos_ids [L, 3], text [B, Lt, D]) -> [B, L, patch_dim]."""

    def __init__(self, model_cfg):
        super().__init__()
        h, self.heads = model_cfg.hidden_size, model_cfg.num_attention_heads
        patch_dim = model_cfg.in_channels * model_cfg.patch_temporal * model_cfg.patch_spatial**2
        self.pos_embedding = model_cfg.pos_embedding
        self.cross = model_cfg.architecture != "dit_adaln"
        self.x_embedder = nn.Linear(patch_dim, h)
        self.t_embedder = nn.Sequential(nn.Linear(256, h), nn.SiLU(), nn.Linear(h, h))
        if self.cross:
            self.y_embedder = nn.Sequential(
                nn.Linear(model_cfg.text_embed_dim, h), nn.GELU(approximate="tanh"), nn.Linear(h, h)
            )
        self.blocks = nn.ModuleList(Block(h, self.heads, self.cross) for _ in range(model_cfg.num_layers))
        self.final_norm = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
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
            rope = rope_3d_freqs(pos_ids, x.shape[-1] // self.heads)[:, 0, 0]
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


def _segments(cu_real: Tensor, cu_padded: Tensor) -> list[tuple[int, int]]:
    return list(zip(cu_padded[:-1].tolist(), segment_lengths(cu_real).tolist()))


def batches_from_pack(pack: PackedBatch) -> list[ShapeBatch]:
    """Regroup a (CPU) pack's samples by latent shape into fixed-size batches."""
    video = _segments(pack.cu_seqlens_q, pack.cu_seqlens_q_padded)
    text = _segments(pack.cu_seqlens_kv, pack.cu_seqlens_kv_padded)
    groups: dict[tuple, list[int]] = {}
    for i, shape in enumerate(pack.latent_shape.tolist()):
        groups.setdefault(tuple(shape), []).append(i)
    batches = []
    for members in groups.values():
        start, length = video[members[0]]
        latents = torch.stack([pack.latents[video[i][0] : video[i][0] + length] for i in members])
        longest = max(text[i][1] for i in members)
        padded = torch.zeros(len(members), longest, pack.context.shape[1])
        mask = torch.zeros(len(members), 1, 1, longest, dtype=torch.bool)
        for row, i in enumerate(members):
            t0, n = text[i]
            padded[row, :n] = pack.context[t0 : t0 + n]
            mask[row, ..., :n] = True
        batches.append(ShapeBatch(latents, pack.pos_ids[start : start + length], padded, None if mask.all() else mask))
    return batches
