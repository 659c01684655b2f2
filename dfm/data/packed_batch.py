"""The packed micro-batch: the one contract between data, pipelines and models.

Several samples (images are T=1 videos) are concatenated along the sequence (THD layout).
Sample i occupies tokens ``[cu_seqlens_q_padded[i], cu_seqlens_q_padded[i] + seqlens_q[i])``;
the rest of its padded segment is padding (loss_mask 0, attends to nothing, output ignored).
Text is laid out the same way with the ``*_kv`` fields. No token attends across samples.

Batches are built on the host and copied to the device once per micro-batch. The device copy
keeps the host original (``host``), so code that needs the segment layout as Python numbers
(per-segment loops, CP and ST-DiT index building) reads it there instead of syncing with the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch


def segment_lengths(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[N+1] cumulative offsets -> [N] lengths, on their device (no sync)."""
    return cu_seqlens[1:] - cu_seqlens[:-1]


@dataclass
class PackedBatch:
    latents: torch.Tensor  # [S, C*pt*ph*pw] clean patchified latents
    context: torch.Tensor  # [S_kv, D_text] text embeddings
    cu_seqlens_q: torch.Tensor  # [N+1] int32, cumulative real video-token lengths
    cu_seqlens_q_padded: torch.Tensor  # [N+1] int32, segment offsets incl. padding; [-1] == S
    cu_seqlens_kv: torch.Tensor  # [N+1] int32, cumulative real text lengths
    cu_seqlens_kv_padded: torch.Tensor  # [N+1] int32; [-1] == S_kv
    pos_ids: torch.Tensor  # [S, 3] long, (t, h, w) patch coordinates within its sample
    loss_mask: torch.Tensor  # [S] float, 1 on real tokens
    latent_shape: torch.Tensor  # [N, 4] long, (C, T, H, W) of each sample's latent
    sample_index: torch.Tensor  # [N] long, global sample index (seeds noise, proves layout independence)
    pooled_text: torch.Tensor | None = None  # [N, D_pool] one pooled text vector per sample (FLUX); None: none
    # HunyuanVideo 1.5: per-token condition features (condition latents + mask), a second text (ByT5)
    # laid out as ``context`` with its own cu_seqlens, and image embeddings per sample (all zero: none).
    condition: torch.Tensor | None = None  # [S, D_cond]
    context_2: torch.Tensor | None = None  # [S_kv2, D_text2]
    cu_seqlens_kv2: torch.Tensor | None = None  # [N+1] int32
    cu_seqlens_kv2_padded: torch.Tensor | None = None  # [N+1] int32; [-1] == S_kv2
    image_embeds: torch.Tensor | None = None  # [N, L_img, D_img]
    # [N] bool: the sample's first latent frame is a clean condition (Wan 2.2 TI2V); None: no sample's is
    first_frame_clean: torch.Tensor | None = None
    # [N] long: the Wan 2.2 expert each sample is routed to (0 high noise, 1 low noise; set by the
    # training step of a model.wan_expert=both run, dfm/models/wan/experts.py); None: one model
    expert_ids: torch.Tensor | None = None
    # Wan 2.2 I2V-A14B: per-token mask + image-condition latent, appended to x_in's features by the model
    image_condition: torch.Tensor | None = None  # [S, pt*ph*pw*(4 + C)]
    # The samples' training draws, made by the loader (dfm/data/pack_draws.py); None: the step draws them.
    noise: torch.Tensor | None = None  # [S, D] fp32 standard normal, zero on padding
    draws: torch.Tensor | None = None  # [N, levels + 1] fp32: each sample's level numbers, its text-drop number
    # The host original of a device copy (set by .to()); None when this batch is the original.
    host: PackedBatch | None = field(default=None, repr=False, compare=False)

    @property
    def num_samples(self) -> int:
        return int(self.latent_shape.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.latents.shape[0])

    @property
    def sample_lengths(self) -> torch.Tensor:
        """[N] int32 real video tokens of each sample."""
        return segment_lengths(self.cu_seqlens_q)

    @property
    def padded_sample_lengths(self) -> torch.Tensor:
        """[N] int32 video segment lengths, padding included."""
        return segment_lengths(self.cu_seqlens_q_padded)

    @property
    def text_lengths(self) -> torch.Tensor:
        """[N] int32 real text tokens of each sample."""
        return segment_lengths(self.cu_seqlens_kv)

    @property
    def padded_text_lengths(self) -> torch.Tensor:
        """[N] int32 text segment lengths, padding included."""
        return segment_lengths(self.cu_seqlens_kv_padded)

    def host_sample_lengths(self) -> list[int]:
        """``sample_lengths`` as Python ints, read from the host original (no device sync)."""
        return self.host_view().sample_lengths.tolist()

    def host_text_lengths(self) -> list[int]:
        """``text_lengths`` as Python ints, read from the host original (no device sync)."""
        return self.host_view().text_lengths.tolist()

    def num_real_tokens(self) -> int:
        return int(self.host_view().loss_mask.sum())

    def token_sample_ids(self) -> torch.Tensor:
        """[S] long: which sample each token (padding included) belongs to (no device sync)."""
        lengths = self.padded_sample_lengths.long()
        samples = torch.arange(len(lengths), device=lengths.device)
        return torch.repeat_interleave(samples, lengths, output_size=self.seq_len)

    def host_view(self) -> PackedBatch:
        """This batch with host tensors: the original it was copied from, itself when it is on
        the host, or (a device sync) a fresh copy back."""
        if self.host is not None:
            return self.host
        if self.latents.device.type == "cpu":
            return self
        return PackedBatch(**self._tensors_to("cpu"))

    def to(self, device: torch.device | str) -> PackedBatch:
        """The copy on ``device``, keeping the host original (also when ``device`` is the CPU, so
        that CPU runs take the same path)."""
        return PackedBatch(**self._tensors_to(device), host=self.host_view())

    def _tensors_to(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        tensors = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "host"}
        return {name: None if value is None else value.to(device) for name, value in tensors.items()}
