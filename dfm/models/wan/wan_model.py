"""Wan 2.1 (text-to-video) on megatron-core: the packed DiT model (dfm/models/dit/dit_model.py)
with Wan's conditioning, blocks and head. The oracle is diffusers' ``WanTransformer3DModel``
(tests/wan prove equal outputs and gradients).

* patch embedding: a Linear on dfm's patchified tokens, features (pt, ph, pw, c) (Wan's Conv3d
  with kernel = stride = patch);
* conditioning: sinusoidal timestep (cos, sin) -> MLP = temb [N, h]; one shared
  ``time_proj(silu(temb))`` [N, 6h] modulates every block (plus each block's table);
* text: each sample's text zero-padded to ``model.max_text_len`` (text_padding.py), then the
  GELU-tanh text MLP;
* 3D RoPE on interleaved channel pairs (megatron's ``rotary_interleaved``), from each token's
  own (t, h, w) patch coordinates;
* head: affine-free norm modulated by its table + temb, then the linear to patch features;
* per-token timesteps (Wan 2.2 TI2V): the first frame of a sample flagged ``first_frame_clean``
  is conditioned on timestep 0, the rest of the pack on its sample's; as the timestep takes two
  values per pack at most, the conditioning runs on N + 1 rows (the last one timestep 0) and each
  token reads its row, instead of diffusers' MLP per token;
* image condition (Wan 2.2 I2V-A14B, ``model.wan_image_condition``): each token's features are its
  noisy latent's then the pack's ``image_condition`` (mask + image latent) per patch position, the
  input diffusers' Conv3d reads from cat([latents, condition]) on channels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dfm.data.packed_batch import PackedBatch
from dfm.data.video_condition import wan_condition_channels
from dfm.diffusion.first_frame import first_frame_tokens
from dfm.models.common.init import zero_init
from dfm.models.common.pack_inputs import PackInputs
from dfm.models.common.packed_model import replicate_across_stages
from dfm.models.dit.dit_model import DiTModel
from dfm.models.wan.text_padding import pad_text_per_sample
from dfm.models.wan.wan_head import WanHead
from dfm.models.wan.wan_layer import NUM_BLOCK_MODULATIONS
from dfm.parallel.layout import layout_of
from dfm.parallel.sequence_split import SequenceSplit


class WanModel(DiTModel):
    """Packed Wan: (x_in [S, D], c_noise [N] = 1000 t, batch) -> velocity [S, D] (last stage)."""

    def __init__(self, config, layer_spec, model_cfg, pre_process=True, post_process=True, vp_stage=None):
        if model_cfg.pos_embedding != "rope3d" or model_cfg.num_classes:
            raise ValueError("model.architecture=wan needs model.pos_embedding=rope3d and no model.num_classes")
        layout = layout_of(config)
        if layout.sp and model_cfg.max_text_len % layout.tp:
            raise ValueError(
                f"model.max_text_len={model_cfg.max_text_len} must be a multiple of "
                f"{layout.key('tp')}={layout.tp} under sequence parallelism"
            )
        super().__init__(config, layer_spec, model_cfg, pre_process, post_process, vp_stage)
        h = config.hidden_size
        # Registered after the head: the parameter order (grad buckets, norms) stays what it was.
        self.time_proj = replicate_across_stages(zero_init(nn.Linear(h, NUM_BLOCK_MODULATIONS * h)))

    def build_embedding(self) -> dict[str, nn.Module]:
        """The patch embedding reads the image condition's channels too (I2V)."""
        cfg = self.model_cfg
        width = (cfg.in_channels + wan_condition_channels(cfg)) * cfg.patch_temporal * cfg.patch_spatial**2
        return {**super().build_embedding(), "x_embedder": nn.Linear(width, self.config.hidden_size)}

    def embed(self, x_local: Tensor, batch: PackedBatch, split: SequenceSplit) -> Tensor:
        if self.model_cfg.wan_image_condition:
            if batch.image_condition is None:
                raise ValueError(
                    "model.wan_image_condition (Wan 2.2 I2V) needs the image condition per sample: data prepared "
                    "with --wan_image_condition, or --image in generation"
                )
            x_local = with_image_condition(x_local, split.local(batch.image_condition), self.model_cfg)
        return super().embed(x_local, batch, split)

    def build_head(self, layer_spec) -> nn.Module:
        return WanHead(self.config.hidden_size, self.out_dim, self.config.layernorm_epsilon)

    def conditioning(self, c_noise: Tensor, class_labels: Tensor | None = None) -> Tensor:
        """[N] timesteps (1000 t) -> [N + 1, 7, h]: temb, then time_proj(silu(temb)) as 6 rows; the
        last of the N + 1 is timestep 0 (clean first frames)."""
        temb = self.t_embedder(torch.cat([c_noise, c_noise.new_zeros(1)]))
        blocks = self.time_proj(F.silu(temb)).unflatten(1, (NUM_BLOCK_MODULATIONS, -1))
        return torch.cat([temb.unsqueeze(1), blocks], dim=1)

    def conditioning_rows(self, batch: PackedBatch) -> Tensor:
        """[S] long: each token's sample, or row N (timestep 0) for a clean first frame's token."""
        rows = batch.token_sample_ids()
        clean = first_frame_tokens(batch)
        return rows if clean is None else torch.where(clean, batch.num_samples, rows)

    def pack_inputs(
        self, batch: PackedBatch, split: SequenceSplit, cond: Tensor, token_ids: Tensor | None = None
    ) -> PackInputs:
        return super().pack_inputs(pad_text_per_sample(batch, self.model_cfg.max_text_len), split, cond, token_ids)


def with_image_condition(x: Tensor, condition: Tensor, model_cfg) -> Tensor:
    """x [s, P*C], condition [s, P*C_cond] (P = pt*ph*pw patch positions) -> [s, P*(C + C_cond)]: per
    position the latent's channels, then the condition's (diffusers' cat([latents, condition], dim=1))."""
    positions = model_cfg.patch_temporal * model_cfg.patch_spatial**2
    parts = (x.unflatten(1, (positions, -1)), condition.to(x.dtype).unflatten(1, (positions, -1)))
    return torch.cat(parts, dim=-1).flatten(1)
