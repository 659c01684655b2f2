"""A model split into pipeline stages, called as one: ``net(x_in, c_noise, batch) -> out`` on every rank.

A sampler calls its model once per solver step with the whole pack. Under pipeline parallelism each
stage holds some of the layers, so a call runs megatron's schedule forward-only for one micro-batch
(the pack) and the last stage's output [S, D] is broadcast over the pipeline group: every rank's
sampler then takes the same step. Tensor, sequence and context parallelism need nothing here: the
model's forward returns the whole pack on every rank of those groups (packed_model.py).
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from torch import Tensor, nn

from dfm.data.packed_batch import PackedBatch
from dfm.training.setup import schedule_model_and_data


class StagedModel:
    """Model chunks (this rank's pipeline stages) as one denoiser; ``parameters()`` are the first chunk's."""

    def __init__(self, chunks: list[nn.Module]) -> None:
        self.chunks = chunks

    def parameters(self):
        return self.chunks[0].parameters()

    def __call__(self, x_in: Tensor, c_noise: Tensor, batch: PackedBatch) -> Tensor:
        """x_in [S, D], c_noise [N] -> the model's output [S, D], on every pipeline stage."""

        def forward(_data, chunk: nn.Module):
            return chunk(x_in, c_noise, batch), None  # no loss function: megatron keeps the output

        # The interleaved (virtual pipeline) schedule needs at least PP micro-batches: the pack that many
        # times, the first output kept. One micro-batch otherwise.
        microbatches = parallel_state.get_pipeline_model_parallel_world_size() if len(self.chunks) > 1 else 1
        outputs = get_forward_backward_func()(
            forward_step_func=forward,
            **schedule_model_and_data(self.chunks, iter([None] * microbatches)),
            num_microbatches=microbatches,
            seq_length=1,
            micro_batch_size=1,
            forward_only=True,
        )
        out = outputs[0] if parallel_state.is_pipeline_last_stage(ignore_virtual=True) else torch.empty_like(x_in)
        if out.shape != x_in.shape:
            raise ValueError(f"the last stage's output {tuple(out.shape)} is not the input's {tuple(x_in.shape)}")
        last = parallel_state.get_pipeline_model_parallel_last_rank()
        torch.distributed.broadcast(out, src=last, group=parallel_state.get_pipeline_model_parallel_group())
        return out


def sampling_model(chunks: list[nn.Module]) -> nn.Module | StagedModel:
    """What a sampler calls: the one chunk itself, or the stages as one (``StagedModel``)."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1 and len(chunks) == 1:
        return chunks[0]
    return StagedModel(chunks)
