"""Both Wan 2.2 A14B experts as one model (``model.wan_expert=both``): one training run, each sample
of a pack through the expert of its timestep.

The parameters are the two experts' under ``high_noise.`` (diffusers' ``transformer``, t >=
boundary_ratio) and ``low_noise.`` (``transformer_2``): one DDP module, so both are sharded as any
model (TP / SP, DP, the distributed optimizer), and each expert's names are those of a one-expert
model behind its prefix, so each loads from and exports to its own diffusers folder.

A pack is split into one sub-pack per expert (its samples' padded segments, dfm/data/packing.py
``sub_pack``) and each expert runs on its own sub-pack only: no sample runs through both. The
outputs go back to the pack's rows, so the loss is the whole pack's. An expert without samples in a
pack still takes part in the backward (a zero times its parameters' sum): every parameter gets its
(zero) gradient, as megatron's DDP with overlapped reduction waits for every parameter's.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from dfm.data.packed_batch import PackedBatch
from dfm.data.packing import rows_padded, sub_pack
from dfm.diffusion.timestep_experts import EXPERTS
from dfm.models.wan.wan_model import WanModel


class WanExperts(MegatronModule):
    """(x_in [S, D], c_noise [N], batch) -> [S, D_out]: each sample through its expert.

    Packs carry ``batch.expert_ids``: the training step routes each sample by its drawn t. Sampling
    runs the two experts as TimestepExperts instead (``sampling_net``: each step by its t, at the
    boundary in the run's c_noise units), so no route is ever read back from c_noise here."""

    def __init__(self, high_noise: MegatronModule, low_noise: MegatronModule, boundary_ratio: float):
        super().__init__(config=high_noise.config)
        self.high_noise, self.low_noise = high_noise, low_noise
        self.boundary_ratio = boundary_ratio
        self.model_type = high_noise.model_type
        self.share_embeddings_and_output_weights = False  # read by megatron finalize_model_grads
        self.layout = high_noise.layout

    def submodels(self) -> dict[str, MegatronModule]:
        """{expert name: model}, the names being the parameters' prefixes and the import's folders."""
        return {"high_noise": self.high_noise, "low_noise": self.low_noise}

    def global_param_name(self, name: str) -> str:
        expert, rest = name.split(".", 1)
        return f"{expert}.{self.submodels()[expert].global_param_name(rest)}"

    def set_input_tensor(self, input_tensor) -> None:
        for model in self.submodels().values():
            model.set_input_tensor(input_tensor)

    def routes(self, batch: PackedBatch) -> list[int]:
        """[N] the expert index (into EXPERTS) of each sample."""
        expert_ids = batch.host_view().expert_ids
        if expert_ids is None:
            raise ValueError(
                "both Wan 2.2 experts in one model need batch.expert_ids (the training step's routes by t); "
                "sample them through dfm.diffusion.timestep_experts.sampling_net"
            )
        return expert_ids.tolist()

    def forward(self, x_in: Tensor, c_noise: Tensor, batch: PackedBatch, extra: Tensor | None = None) -> Tensor:
        routes = self.routes(batch)
        outputs, untouched = [], []
        for index, expert in enumerate(EXPERTS):
            keep = [sample for sample, route in enumerate(routes) if route == index]
            model = self.submodels()[expert]
            if keep:
                outputs.append(self.run_expert(model, keep, x_in, c_noise, batch, extra))
            else:
                untouched.append(model)
        out = None
        for rows, y in outputs:
            if out is None:
                out = y.new_zeros((x_in.shape[0], y.shape[1]))
            out = out.index_copy(0, rows, y[: rows.numel()])
        for model in untouched if torch.is_grad_enabled() else []:  # a (zero) gradient for every parameter
            out = out + 0.0 * sum(param.sum() for param in model.parameters() if param.requires_grad)
        return out

    def run_expert(self, model, keep: list[int], x_in: Tensor, c_noise: Tensor, batch: PackedBatch, extra):
        """-> (rows [S_keep] of the pack, ``model``'s output [S_sub, D_out]) on the samples ``keep``."""
        sub, rows = sub_pack(batch.host_view(), keep, self.layout.padding_multiples()[1])
        sub, rows = sub.to(x_in.device), rows.to(x_in.device)
        index = torch.tensor(keep, device=c_noise.device)
        return rows, model(
            rows_padded(x_in, rows, sub.seq_len), c_noise[index], sub, None if extra is None else extra[index]
        )


def wan_model(config, layer_spec, model_cfg, pre_process=True, post_process=True, vp_stage=None) -> MegatronModule:
    """The Wan family's model: one WanModel, or both experts of ``model.wan_expert=both``."""
    if model_cfg.wan_expert != "both":
        return WanModel(config, layer_spec, model_cfg, pre_process, post_process, vp_stage)
    experts = [WanModel(config, layer_spec, model_cfg, pre_process, post_process, vp_stage) for _ in EXPERTS]
    return WanExperts(*experts, boundary_ratio=model_cfg.wan_boundary_ratio)
