"""HunyuanVideo 1.5's condition embedders (first pipeline stage, replicated over TP like FLUX's
text embedder): the Qwen2.5-VL token refiner, the ByT5 projection and the SigLIP image projection.

Token refiner block (self-attention within each sample's Qwen tokens, gates from timestep + pooled text):

    x = x + gate_msa * Attn(LayerNorm(x))
    x = x + gate_mlp * MLP_silu(LayerNorm(x))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dfm.models.common.adaln import rows_to_tokens
from dfm.models.common.embeddings import TimestepEmbedder
from dfm.models.flux.flux_model import pooled_text_embedder
from dfm.models.hunyuan.text_stream import TextStreamPlan

BYT5_HIDDEN = 2048  # diffusers' HunyuanVideo15ByT5TextProjection hidden width, fixed
REFINER_EPS = 1e-6


class RefinerBlock(nn.Module):
    """One token-refiner block over packed text rows x [S_kv, h]."""

    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(hidden_size, eps=REFINER_EPS)
        self.linear_q, self.linear_k, self.linear_v = (nn.Linear(hidden_size, hidden_size) for _ in range(3))
        self.linear_proj = nn.Linear(hidden_size, hidden_size)
        self.norm2 = nn.LayerNorm(hidden_size, eps=REFINER_EPS)
        self.mlp = nn.Sequential(
            nn.Linear(hidden_size, 4 * hidden_size), nn.SiLU(), nn.Linear(4 * hidden_size, hidden_size)
        )
        self.adaln = nn.Linear(hidden_size, 2 * hidden_size)

    def forward(self, x: Tensor, temb: Tensor, plan: TextStreamPlan, core_attention) -> Tensor:
        """x [S_kv, h], temb [N, h] -> [S_kv, h]; ``core_attention`` the blocks' packed kernel."""
        y = self.norm1(x)
        heads = [
            linear(y).view(y.shape[0], 1, self.num_heads, -1)
            for linear in (self.linear_q, self.linear_k, self.linear_v)
        ]
        attention = core_attention(*heads, attention_mask=None, packed_seq_params=plan.qwen_segments)[:, 0]
        gate_msa, gate_mlp = rows_to_tokens(self.adaln(F.silu(temb)), plan.qwen_sample_ids).chunk(2, dim=-1)
        x = x + self.linear_proj(attention) * gate_msa
        return x + self.mlp(self.norm2(x)) * gate_mlp


class TokenRefiner(nn.Module):
    """Qwen text [S_kv, D_text] + timestep [N] -> refined tokens [S_kv, h]."""

    def __init__(self, text_dim: int, hidden_size: int, num_heads: int, num_layers: int):
        super().__init__()
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.pooled_embedder = pooled_text_embedder(text_dim, hidden_size)
        self.proj_in = nn.Linear(text_dim, hidden_size)
        self.blocks = nn.ModuleList(RefinerBlock(hidden_size, num_heads) for _ in range(num_layers))

    def forward(self, text: Tensor, c_noise: Tensor, plan: TextStreamPlan, core_attention) -> Tensor:
        real = text[plan.qwen_real_rows]
        sums = torch.zeros(len(plan.qwen_lengths), text.shape[1], dtype=text.dtype, device=text.device)
        pooled = sums.index_add(0, plan.qwen_sample_ids[plan.qwen_real_rows], real) / plan.qwen_lengths[:, None]
        temb = self.t_embedder(c_noise) + self.pooled_embedder(pooled.to(text.dtype))
        x = self.proj_in(text)
        for block in self.blocks:
            x = block(x, temb, plan, core_attention)
        return x


def byt5_embedder(text_dim: int, hidden_size: int) -> nn.Sequential:
    """ByT5 features [s, D_byt5] -> [s, h]: LayerNorm, then Linear-GELU-Linear-GELU-Linear."""
    return nn.Sequential(
        nn.LayerNorm(text_dim),
        nn.Linear(text_dim, BYT5_HIDDEN),
        nn.GELU(),
        nn.Linear(BYT5_HIDDEN, BYT5_HIDDEN),
        nn.GELU(),
        nn.Linear(BYT5_HIDDEN, hidden_size),
    )


def image_embedder(image_dim: int, hidden_size: int) -> nn.Sequential:
    """SigLIP image tokens [s, D_img] -> [s, h]: LayerNorm, Linear, GELU, Linear, LayerNorm."""
    return nn.Sequential(
        nn.LayerNorm(image_dim),
        nn.Linear(image_dim, image_dim),
        nn.GELU(),
        nn.Linear(image_dim, hidden_size),
        nn.LayerNorm(hidden_size),
    )
